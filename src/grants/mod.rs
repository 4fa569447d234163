//! Installation-wide upstream limits on Kubernetes: each upstream's `max_concurrency`
//! is divided among the worker pods that use it, so that all pods together never have
//! more requests in flight than the limit, and reach it.
//!
//! The controller and the workers talk through object storage (workers hold no
//! Kubernetes credentials): the controller writes each worker's [`Grant`] under
//! `control/grants/<worker>.json`; the worker applies it (growing at once, shrinking
//! once enough of its requests in flight have finished) and answers with an [`Ack`]
//! under `control/acks/<worker>.json`: what it now holds, and which upstreams it has
//! lines for. The controller changes a worker's limits only once its last grant is
//! acknowledged, and counts every worker at the larger of what it was granted and what
//! it acknowledged, so the sum stays within the limit at every instant
//! ([`divide::divide`]). A grant also tells the worker how many workers send to each
//! upstream, its place among them, and what the upstream's users run as the workers saw
//! it together (`crate::concurrency::view`). A worker is a shard's Job, by name: a retried pod of
//! the same Job takes over its grant.

pub mod divide;
pub mod follow;
pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::storage::{Key, ObjectStore, StorageError};

/// What the controller allows a worker: requests in flight, by upstream name (an
/// upstream with a limit that is missing here is allowed none yet), and, when its
/// project has a quota, tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub upstreams: BTreeMap<String, u32>,
    /// How many workers send to each upstream the worker is granted: each reads the
    /// server's load signal and takes its part of the room there
    /// (`crate::concurrency::headroom`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sharing: BTreeMap<String, u32>,
    /// The worker's place among them (from 0), for turns they take
    /// (`crate::exec::permits`'s probe).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub turn: BTreeMap<String, u32>,
    /// The users' requests each upstream the worker is granted holds (runs or queues),
    /// in thousandths, as the workers that send to it saw them together
    /// (`crate::concurrency::view`): its load signal counts the other workers' lines
    /// with theirs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub users: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenGrant>,
}

/// Tokens one run of a worker (one pod) may spend in all; a retried pod is a new run
/// and waits for a grant of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenGrant {
    pub run: String,
    pub allowance: u64,
    /// The project's quota is used up: lines without tokens fail instead of waiting.
    #[serde(default)]
    pub exhausted: bool,
}

/// What a worker holds now (it has applied that grant), which upstreams it has lines
/// for (`wants`: upstreams it does not want are granted to others), and its tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    pub upstreams: BTreeMap<String, u32>,
    #[serde(default)]
    pub wants: BTreeSet<String>,
    /// The worker has exited: it holds nothing any more.
    #[serde(default)]
    pub released: bool,
    /// This run of the worker (unique per pod).
    #[serde(default)]
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenUse>,
    /// What it saw of each upstream, for the installation's adaptive limit.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub observed: BTreeMap<String, Observation>,
}

/// A worker's view of an upstream: its finished requests so far (this run), its
/// requests in flight, and whether it trusts the upstream's load signal.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observation {
    pub counts: crate::concurrency::Counts,
    pub in_flight: u32,
    /// Its load signal is set aside as stale (`crate::concurrency::staleness`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub signal_stale: bool,
    /// Its load signal says the batch is alone at the server, its places known: its own
    /// caps fill them (`crate::concurrency::control::Control::filling`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub filling: bool,
    /// What its load signal saw since its last acknowledgment, if it read one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view: Option<crate::concurrency::view::View>,
}

/// A run's tokens: what its shard had committed when it started (`base`), what it has
/// spent since, and whether it waits for more.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUse {
    pub base: u64,
    pub spent: u64,
    pub waiting: bool,
}

/// How often a worker pod acknowledges its grant, and the controller passes: on the wall
/// clock's beat ([`crate::clock::until_beat`]), so that the pods' views of a server
/// cover the same half second, and the controller reads them a little later.
pub const BEAT: std::time::Duration = std::time::Duration::from_millis(500);

const GRANTS: &str = "control/grants/";
const ACKS: &str = "control/acks/";

pub fn grant_key(worker: &str) -> Key {
    Key::parse(&format!("{GRANTS}{worker}.json")).expect("worker names are valid keys")
}

pub fn ack_key(worker: &str) -> Key {
    Key::parse(&format!("{ACKS}{worker}.json")).expect("worker names are valid keys")
}

async fn read<T: for<'de> Deserialize<'de>>(store: &dyn ObjectStore, key: &Key) -> Result<Option<T>, StorageError> {
    let bytes = match store.get(key).await {
        Ok(bytes) => bytes,
        Err(StorageError::NotFound(_)) => return Ok(None),
        Err(error) => return Err(error),
    };
    // A record that does not parse is one this version did not write: as absent.
    Ok(serde_json::from_slice(&bytes).ok())
}

async fn write<T: Serialize>(store: &dyn ObjectStore, key: &Key, value: &T) -> Result<(), StorageError> {
    let bytes = serde_json::to_vec(value).expect("grants serialize");
    store.put(key, bytes.into()).await
}

pub async fn read_grant(store: &dyn ObjectStore, worker: &str) -> Result<Option<Grant>, StorageError> {
    read(store, &grant_key(worker)).await
}

pub async fn write_grant(store: &dyn ObjectStore, worker: &str, grant: &Grant) -> Result<(), StorageError> {
    write(store, &grant_key(worker), grant).await
}

pub async fn read_ack(store: &dyn ObjectStore, worker: &str) -> Result<Option<Ack>, StorageError> {
    read(store, &ack_key(worker)).await
}

pub async fn write_ack(store: &dyn ObjectStore, worker: &str, ack: &Ack) -> Result<(), StorageError> {
    write(store, &ack_key(worker), ack).await
}

/// Workers that have a grant in storage (the controller's memory, after a failover).
pub async fn granted_workers(store: &dyn ObjectStore) -> Result<Vec<String>, StorageError> {
    let keys = store.list(GRANTS).await?;
    Ok(keys
        .iter()
        .filter_map(|key| key.as_str().strip_prefix(GRANTS)?.strip_suffix(".json").map(str::to_owned))
        .collect())
}

/// Forgets a worker that is gone.
pub async fn remove(store: &dyn ObjectStore, worker: &str) -> Result<(), StorageError> {
    store.delete(&grant_key(worker)).await?;
    store.delete(&ack_key(worker)).await
}
