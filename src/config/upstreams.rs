//! `upstreams:`: the model servers batch lines go to, and how each is governed.

use std::time::Duration;

use serde::Deserialize;

use crate::concurrency::signals::LoadSignalConfig;
use crate::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    pub base_url: String,
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default = "all_models")]
    pub models: Vec<String>,
    /// The most requests in flight: the ceiling under which the adaptive limit moves
    /// (or, with `adaptive: false`, the limit). On Kubernetes, over the installation.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
    /// Find the concurrency by measuring throughput (`crate::concurrency::rule`).
    #[serde(default = "default_adaptive")]
    pub adaptive: bool,
    /// The server's metrics: batch dispatch holds while its interactive requests queue.
    #[serde(default)]
    pub load_signal: LoadSignalSetting,
    /// Set as `priority` on every batch line (vLLM's priority scheduling: interactive
    /// requests have 0 and go first when batch lines have more).
    #[serde(default)]
    pub priority: Option<i64>,
    /// How long one attempt of one request may take.
    #[serde(default = "default_upstream_timeout", deserialize_with = "duration::deserialize")]
    pub timeout: Duration,
    /// The wait before the first retry; doubled for each further one (with jitter).
    #[serde(default = "default_retry_base_delay", deserialize_with = "duration::deserialize_precise")]
    pub retry_base_delay: Duration,
    /// The workload that serves this upstream, whose replicas the controller may change
    /// (`crate::capacity::scale`).
    #[serde(default)]
    pub scale: Option<ScaleConfig>,
}

/// `upstreams[].load_signal`: the server's metrics, set; `false`, none; unset (or
/// `true`), looked for at the server where the limit adapts
/// ([`crate::concurrency::discovery`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum LoadSignalSetting {
    #[default]
    Discover,
    Off,
    Set(LoadSignalConfig),
}

impl LoadSignalSetting {
    pub fn set(&self) -> Option<&LoadSignalConfig> {
        match self {
            Self::Set(signal) => Some(signal),
            Self::Discover | Self::Off => None,
        }
    }
}

impl<'de> Deserialize<'de> for LoadSignalSetting {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Setting;
        impl<'de> serde::de::Visitor<'de> for Setting {
            type Value = LoadSignalSetting;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the server's metrics ({url: ..., server: ...}), or false for none")
            }

            fn visit_bool<E>(self, on: bool) -> Result<Self::Value, E> {
                Ok(if on { LoadSignalSetting::Discover } else { LoadSignalSetting::Off })
            }

            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(LoadSignalSetting::Discover)
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                LoadSignalConfig::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(LoadSignalSetting::Set)
            }
        }
        deserializer.deserialize_any(Setting)
    }
}

/// `upstreams[].scale`: the Deployment or StatefulSet that serves an upstream, and the
/// bounds within which the controller changes its replicas for the batches' backlog.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScaleConfig {
    pub kind: WorkloadKind,
    pub name: String,
    /// Default: the controller's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// The least time between two changes, and of an empty backlog before going back
    /// to `min_replicas`.
    #[serde(default = "default_cooldown", deserialize_with = "duration::deserialize")]
    pub cooldown: Duration,
    /// How long lines wait for a replica to become ready once one is asked for; then
    /// they are sent anyway (and fail or are retried as any line to a server that is down).
    #[serde(default = "default_max_wait", deserialize_with = "duration::deserialize")]
    pub max_wait: Duration,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
}

impl ScaleConfig {
    pub fn validate(&self, upstream: &str) -> Result<(), String> {
        if self.name.is_empty() {
            return Err(format!("upstream {upstream}: scale.name must name the workload"));
        }
        if self.max_replicas == 0 || self.min_replicas > self.max_replicas {
            return Err(format!(
                "upstream {upstream}: scale needs 1 <= max_replicas and min_replicas <= max_replicas (got {} and {})",
                self.min_replicas, self.max_replicas
            ));
        }
        Ok(())
    }

    pub fn bounds(&self) -> crate::capacity::scale::Bounds {
        crate::capacity::scale::Bounds {
            min: self.min_replicas,
            max: self.max_replicas,
            cooldown: self.cooldown.as_secs() as i64,
        }
    }
}

fn default_cooldown() -> Duration {
    Duration::from_secs(300)
}

fn default_max_wait() -> Duration {
    Duration::from_secs(600)
}

/// The built-in model's name.
pub const ECHO_MODEL: &str = "echo";

/// Where the lines of a model go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The upstream at this position in the configuration.
    Upstream(usize),
    /// The built-in `echo` model, served in-process.
    Echo,
    Unserved,
}

/// The first of `upstreams` (each its `models` patterns, in the configuration's order)
/// that serves `model`. The built-in `echo` model serves what no upstream claims when
/// none is configured (so Nightshift works offline), and `echo` always.
pub fn route<'a>(upstreams: impl IntoIterator<Item = &'a [String]>, model: &str) -> Route {
    let mut configured = false;
    for (position, patterns) in upstreams.into_iter().enumerate() {
        configured = true;
        if serves(patterns, model) {
            return Route::Upstream(position);
        }
    }
    match !configured || model == ECHO_MODEL {
        true => Route::Echo,
        false => Route::Unserved,
    }
}

/// Whether one of `patterns` names `model`: the name itself, or a prefix before `*`.
fn serves(patterns: &[String], model: &str) -> bool {
    patterns.iter().any(|pattern| match pattern.strip_suffix('*') {
        Some(prefix) => model.starts_with(prefix),
        None => pattern == model,
    })
}

/// The name of the upstream that serves `model` among `upstreams` (each its name and
/// `models` patterns, in the configuration's order; [`ECHO_MODEL`] for the built-in);
/// `None` for a model none serves.
pub fn name_of<'a, I>(upstreams: I, model: &str) -> Option<String>
where
    I: IntoIterator<Item = (&'a str, &'a [String])> + Clone,
{
    match route(upstreams.clone().into_iter().map(|(_, models)| models), model) {
        Route::Upstream(position) => upstreams.into_iter().nth(position).map(|(name, _)| name.to_owned()),
        Route::Echo => Some(ECHO_MODEL.to_owned()),
        Route::Unserved => None,
    }
}

fn all_models() -> Vec<String> {
    vec!["*".to_owned()]
}

fn default_adaptive() -> bool {
    true
}

fn default_max_concurrency() -> usize {
    64
}

fn default_upstream_timeout() -> Duration {
    Duration::from_secs(600)
}

fn default_retry_base_delay() -> Duration {
    Duration::from_millis(500)
}
