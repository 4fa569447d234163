//! Projects and their API keys: who is calling, decided from the spec's two headers
//! (`x-project-id` and `x-api-key`), or from the OpenAI SDK's own `Authorization: Bearer`
//! key, whose project is the one the key belongs to.
//!
//! Keys are held only as SHA-256 digests and compared in constant time, so neither
//! memory dumps nor response timing reveal a key. A bearer key is found by its digest.

use std::collections::HashMap;

use subtle::ConstantTimeEq;

use crate::config::{ProjectConfig, key_digest};
use crate::ids::ProjectId;

pub const API_KEY_HEADER: &str = "x-api-key";
pub const PROJECT_HEADER: &str = "x-project-id";
/// The project an OpenAI SDK names (`OpenAI(project=...)`, `OPENAI_PROJECT_ID`).
pub const OPENAI_PROJECT_HEADER: &str = "openai-project";

#[derive(Clone, Debug)]
pub struct Project {
    pub id: ProjectId,
    pub name: Option<String>,
    /// Token quota; `None` is unlimited.
    pub quota_tokens: Option<u64>,
    /// Its own request rate limit; `None`: the installation's.
    pub requests_per_minute: Option<u32>,
    /// Where its batch events go.
    pub webhooks: Vec<crate::webhooks::Webhook>,
    /// Its share of capacity (`crate::lifecycle::schedule`).
    pub weight: u32,
    keys: Vec<StoredKey>,
}

#[derive(Clone, Debug)]
struct StoredKey {
    digest: [u8; 32],
    active: bool,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("Missing x-api-key or x-project-id header")]
    MissingHeaders,
    #[error("Invalid API key or project")]
    InvalidCredentials,
    /// A bearer key that no project has (or that two projects share).
    #[error("Incorrect API key provided")]
    UnknownBearerKey,
    /// A bearer key of another project than the `OpenAI-Project` header names.
    #[error("The API key does not belong to the project in the OpenAI-Project header")]
    ProjectMismatch,
}

/// What a request presents to say who it is.
#[derive(Clone, Copy, Debug)]
pub enum Credentials<'a> {
    /// The spec's `x-project-id` and `x-api-key` (either may be missing: 401).
    Headers { project: Option<&'a str>, key: Option<&'a str> },
    /// `Authorization: Bearer <key>`, with the `OpenAI-Project` header if sent.
    Bearer { key: &'a str, project: Option<&'a str> },
}

impl<'a> Credentials<'a> {
    /// The spec's headers when either is sent; else a bearer key; else nothing (401).
    pub fn from_headers(header: impl Fn(&str) -> Option<&'a str>) -> Self {
        let spec = (header(PROJECT_HEADER), header(API_KEY_HEADER));
        let sent = |value: Option<&str>| value.is_some_and(|v| !v.trim().is_empty());
        if sent(spec.0) || sent(spec.1) {
            return Self::Headers { project: spec.0, key: spec.1 };
        }
        let bearer = header("authorization").and_then(|value| {
            let (scheme, key) = value.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim()).filter(|key| !key.is_empty())
        });
        match bearer {
            Some(key) => Self::Bearer { key, project: header(OPENAI_PROJECT_HEADER).filter(|p| !p.trim().is_empty()) },
            None => Self::Headers { project: spec.0, key: spec.1 },
        }
    }
}

/// Every project that may call the API.
#[derive(Clone, Debug, Default)]
pub struct Projects {
    by_id: HashMap<ProjectId, Project>,
    /// Every active key's digest → its project; `None` when two projects share the key,
    /// which then names no project by itself.
    by_key: HashMap<[u8; 32], Option<ProjectId>>,
}

impl Projects {
    pub fn from_config(projects: &[ProjectConfig]) -> Self {
        let by_id = projects
            .iter()
            .map(|project| {
                let keys =
                    project.api_keys.iter().map(|key| StoredKey { digest: key.digest, active: key.active }).collect();
                let entry = Project {
                    id: project.id.clone(),
                    name: project.name.clone(),
                    quota_tokens: project.quota.map(|q| q.tokens),
                    requests_per_minute: project.rate_limit.map(|r| r.requests_per_minute),
                    webhooks: project.webhooks.clone(),
                    weight: project.weight.get(),
                    keys,
                };
                (project.id.clone(), entry)
            })
            .collect::<HashMap<_, _>>();
        let mut by_key: HashMap<[u8; 32], Option<ProjectId>> = HashMap::new();
        for project in by_id.values() {
            for key in project.keys.iter().filter(|key| key.active) {
                by_key
                    .entry(key.digest)
                    .and_modify(|owner| {
                        if owner.as_ref() != Some(&project.id) {
                            *owner = None;
                        }
                    })
                    .or_insert_with(|| Some(project.id.clone()));
            }
        }
        Self { by_id, by_key }
    }

    pub fn get(&self, id: &ProjectId) -> Option<&Project> {
        self.by_id.get(id)
    }

    /// Every project's token quota, for those that have one.
    pub fn iter(&self) -> impl Iterator<Item = &Project> + '_ {
        self.by_id.values()
    }

    pub fn quotas(&self) -> impl Iterator<Item = (ProjectId, u64)> + '_ {
        self.by_id.values().filter_map(|p| p.quota_tokens.map(|q| (p.id.clone(), q)))
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Decides who is calling.
    pub fn authenticate_with(&self, credentials: Credentials<'_>) -> Result<&Project, AuthError> {
        match credentials {
            Credentials::Headers { project, key } => self.authenticate(project, key),
            Credentials::Bearer { key, project } => self.authenticate_bearer(key, project),
        }
    }

    /// A bearer key names its project; an `OpenAI-Project` header, if sent, must name the
    /// same one.
    fn authenticate_bearer(&self, key: &str, project_header: Option<&str>) -> Result<&Project, AuthError> {
        let owner = self.by_key.get(&key_digest(key)).cloned().flatten().ok_or(AuthError::UnknownBearerKey)?;
        if project_header.is_some_and(|named| ProjectId::parse(named.trim()).as_ref() != Some(&owner)) {
            return Err(AuthError::ProjectMismatch);
        }
        self.by_id.get(&owner).ok_or(AuthError::UnknownBearerKey)
    }

    /// Decides who sent `x-project-id` and `x-api-key`. A missing (or empty) header is
    /// 401; anything else that does not match an active key of that project is 403.
    pub fn authenticate(&self, project_header: Option<&str>, key_header: Option<&str>) -> Result<&Project, AuthError> {
        let (Some(project), Some(key)) =
            (project_header.filter(|v| !v.trim().is_empty()), key_header.filter(|v| !v.is_empty()))
        else {
            return Err(AuthError::MissingHeaders);
        };
        let presented = key_digest(key);
        let project =
            ProjectId::parse(project).and_then(|id| self.by_id.get(&id)).ok_or(AuthError::InvalidCredentials)?;
        // Look at every key, so timing does not tell how many were tried.
        let mut matched = subtle::Choice::from(0);
        for stored in &project.keys {
            matched |= stored.digest.ct_eq(&presented) & subtle::Choice::from(u8::from(stored.active));
        }
        if bool::from(matched) { Ok(project) } else { Err(AuthError::InvalidCredentials) }
    }
}

/// The projects in force, replaced whole when they change (Project resources on
/// Kubernetes); readers take a snapshot.
#[derive(Default)]
pub struct ProjectDirectory {
    current: std::sync::RwLock<std::sync::Arc<Projects>>,
}

impl ProjectDirectory {
    pub fn new(projects: Projects) -> Self {
        Self { current: std::sync::RwLock::new(std::sync::Arc::new(projects)) }
    }

    pub fn current(&self) -> std::sync::Arc<Projects> {
        self.current.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    pub fn replace(&self, projects: Projects) {
        *self.current.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = std::sync::Arc::new(projects);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ApiKeyConfig, Weight};

    const PROJECT: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
    const OTHER: &str = "0b7e8a52-4a1c-4d5e-9a53-6f0c7d8e9f10";

    fn projects() -> Projects {
        Projects::from_config(&[
            ProjectConfig {
                id: ProjectId::parse(PROJECT).unwrap(),
                name: None,
                api_keys: vec![
                    ApiKeyConfig::plain("plain-key"),
                    ApiKeyConfig::sha256(&hex::encode(key_digest("hashed-key")), true).unwrap(),
                    ApiKeyConfig { active: false, ..ApiKeyConfig::plain("retired-key") },
                ],
                quota: None,
                rate_limit: None,
                webhooks: Vec::new(),
                weight: Weight::default(),
            },
            ProjectConfig {
                id: ProjectId::parse(OTHER).unwrap(),
                name: None,
                api_keys: vec![ApiKeyConfig::plain("other-key"), ApiKeyConfig::plain("shared-key")],
                quota: None,
                rate_limit: None,
                webhooks: Vec::new(),
                weight: Weight::default(),
            },
            ProjectConfig {
                id: ProjectId::parse(THIRD).unwrap(),
                name: None,
                api_keys: vec![ApiKeyConfig::plain("shared-key")],
                quota: None,
                rate_limit: None,
                webhooks: Vec::new(),
                weight: Weight::default(),
            },
        ])
    }

    const THIRD: &str = "9d3c2b1a-0f0e-4d0c-8b0a-090807060504";

    fn from(headers: &[(&'static str, &'static str)]) -> Credentials<'static> {
        let headers = headers.to_vec();
        Credentials::from_headers(move |name| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v))
    }

    #[test]
    fn a_bearer_key_names_its_project_and_the_openai_project_header_must_agree() {
        let projects = projects();
        let who = |headers: &[(&'static str, &'static str)]| {
            projects.authenticate_with(from(headers)).map(|p| p.id.to_string())
        };
        assert_eq!(who(&[("authorization", "Bearer plain-key")]).unwrap(), PROJECT);
        assert_eq!(who(&[("authorization", "bearer hashed-key")]).unwrap(), PROJECT);
        assert_eq!(who(&[("authorization", "Bearer other-key"), ("openai-project", OTHER)]).unwrap(), OTHER);
        assert_eq!(
            who(&[("authorization", "Bearer other-key"), ("openai-project", PROJECT)]).unwrap_err(),
            AuthError::ProjectMismatch
        );
        for unknown in ["Bearer wrong", "Bearer retired-key", "Bearer shared-key"] {
            assert_eq!(who(&[("authorization", unknown)]).unwrap_err(), AuthError::UnknownBearerKey, "{unknown}");
        }
        // Not a bearer key: as if nothing was sent.
        for nothing in ["Basic cGxhaW4ta2V5", "Bearer ", "plain-key"] {
            assert_eq!(who(&[("authorization", nothing)]).unwrap_err(), AuthError::MissingHeaders, "{nothing}");
        }
        // The spec's headers, when sent, decide alone: a bearer key beside them is ignored.
        let spec = [("x-project-id", PROJECT), ("x-api-key", "wrong"), ("authorization", "Bearer plain-key")];
        assert_eq!(who(&spec).unwrap_err(), AuthError::InvalidCredentials);
        let half = [("x-project-id", PROJECT), ("authorization", "Bearer plain-key")];
        assert_eq!(who(&half).unwrap_err(), AuthError::MissingHeaders);
    }

    #[test]
    fn plain_and_hashed_keys_authenticate_their_project() {
        let projects = projects();
        assert_eq!(projects.authenticate(Some(PROJECT), Some("plain-key")).unwrap().id.as_str(), PROJECT);
        assert!(projects.authenticate(Some(&PROJECT.to_uppercase()), Some("hashed-key")).is_ok());
    }

    #[test]
    fn missing_headers_are_401_and_wrong_ones_403() {
        let projects = projects();
        assert_eq!(projects.authenticate(None, Some("plain-key")).unwrap_err(), AuthError::MissingHeaders);
        assert_eq!(projects.authenticate(Some(PROJECT), None).unwrap_err(), AuthError::MissingHeaders);
        assert_eq!(projects.authenticate(Some(PROJECT), Some("")).unwrap_err(), AuthError::MissingHeaders);
        for (project, key) in [
            (PROJECT, "wrong"),
            (PROJECT, "retired-key"),
            (PROJECT, "other-key"),
            (OTHER, "plain-key"),
            ("not-a-uuid", "plain-key"),
            ("6a0c1e8e-0000-4000-8000-000000000000", "plain-key"),
        ] {
            assert_eq!(
                projects.authenticate(Some(project), Some(key)).unwrap_err(),
                AuthError::InvalidCredentials,
                "{project} {key}"
            );
        }
    }
}
