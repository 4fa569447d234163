//! `storage:`: a local directory or an S3-compatible bucket.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageConfig {
    /// Local directory storage (the embedded default).
    pub dir: Option<PathBuf>,
    /// S3-compatible object storage; wins over `dir` when both are given.
    pub s3: Option<S3Config>,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self { dir: Some(PathBuf::from("./nightshift-data")), s3: None }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    pub bucket: String,
    pub endpoint: Option<String>,
    #[serde(default = "default_region")]
    pub region: String,
    #[serde(default)]
    pub prefix: String,
    #[serde(default)]
    pub path_style: bool,
    /// Environment variables holding a static access key pair, read once at start: for an
    /// S3-compatible server with keys under names of your own. Unset (both), the AWS SDK's
    /// default chain finds the credentials and refreshes them: `AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY`, the shared profile files, web identity (IRSA), container
    /// credentials (EKS Pod Identity, ECS), instance metadata.
    #[serde(default)]
    pub access_key_id_env: Option<String>,
    #[serde(default)]
    pub secret_access_key_env: Option<String>,
    /// How long a request waits for the server's next bytes before its attempt fails
    /// and is tried again (a stalled server is an error, not a hang).
    #[serde(default = "default_s3_timeout", deserialize_with = "duration::deserialize_precise")]
    pub timeout: Duration,
}

fn default_s3_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_region() -> String {
    "us-east-1".to_owned()
}
