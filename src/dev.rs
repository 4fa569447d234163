//! The development project that `nightshift serve` makes when no project is configured.
//!
//! Its credentials are kept in storage (`dev/credentials.json`), so a restart keeps
//! the same project and key, and the quickstart can find them.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::config::{ApiKeyConfig, ProjectConfig, Weight};
use crate::ids::ProjectId;
use crate::storage::{Key, ObjectStore, StorageError};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DevCredentials {
    pub project_id: ProjectId,
    pub api_key: String,
}

impl DevCredentials {
    pub fn project(&self) -> ProjectConfig {
        ProjectConfig {
            id: self.project_id.clone(),
            name: Some("dev".to_owned()),
            api_keys: vec![ApiKeyConfig::plain(&self.api_key)],
            quota: None,
            rate_limit: None,
            webhooks: Vec::new(),
            weight: Weight::default(),
        }
    }
}

fn key() -> Key {
    Key::from_segments(&["dev", "credentials.json"])
}

/// The stored dev credentials, made on first use.
pub async fn load_or_create(store: &dyn ObjectStore) -> Result<DevCredentials, StorageError> {
    match store.get(&key()).await {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map_err(|e| StorageError::Corrupt(format!("dev/credentials.json: {e}")))
        }
        Err(StorageError::NotFound(_)) => {
            let secret: [u8; 24] = rand::random();
            let credentials = DevCredentials {
                project_id: ProjectId::generate(),
                api_key: format!("ns-dev-{}", hex::encode(secret)),
            };
            let json = serde_json::to_vec_pretty(&credentials).expect("credentials serialize");
            store.put(&key(), Bytes::from(json)).await?;
            Ok(credentials)
        }
        Err(error) => Err(error),
    }
}
