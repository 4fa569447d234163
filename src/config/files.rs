//! `files:`: how long files are kept, and how often the sweep runs.

use std::time::Duration;

use serde::Deserialize;

use crate::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesConfig {
    /// How long an upload is kept (OpenAI and the spec: 30 days).
    #[serde(default = "default_retention", deserialize_with = "duration::deserialize")]
    pub retention: Duration,
    /// How often expired and deleted files are swept from storage.
    #[serde(default = "default_gc_interval", deserialize_with = "duration::deserialize")]
    pub gc_interval: Duration,
}

pub(super) fn default_retention() -> Duration {
    Duration::from_secs(30 * 86_400)
}

fn default_gc_interval() -> Duration {
    Duration::from_secs(600)
}

impl Default for FilesConfig {
    fn default() -> Self {
        Self { retention: default_retention(), gc_interval: default_gc_interval() }
    }
}
