//! Object storage: one trait, two implementations (a local directory and S3) that pass
//! the same conformance suite (`tests/api/storage_conformance.rs`).
//!
//! Keys are `/`-separated paths of safe segments ([`Key`]). Writes go through an
//! [`ObjectWriter`] that publishes the object only on [`ObjectWriter::finish`], so a
//! failed or abandoned write never leaves a half-written object behind.

pub mod buckets;
pub mod credentials;

/// A writer that has not written for this long was abandoned (its process died): uploads
/// write continuously, and a stalled client is cut off well before.
pub const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);
/// An S3 multipart upload started this long ago was abandoned (S3 does not say when it
/// last had a part, and the largest upload takes minutes).
pub const ABANDONED_UPLOAD: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
mod dir;
mod dir_index;
mod key;
pub mod newest_first;
mod paging;
mod s3;
pub mod uri;

use std::ops::Range;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

pub use credentials::StaticKeys;
pub use dir::DirStore;
pub use key::Key;
pub use paging::read_page;
pub use s3::{S3Settings, S3Store};

/// A page of a listing.
#[derive(Debug, Default)]
pub struct KeyPage {
    pub keys: Vec<Key>,
    /// Whether more keys follow the page.
    pub more: bool,
}

impl KeyPage {
    /// The page of the directory `prefix` in a whole (sorted) listing of it.
    pub fn of_listing(prefix: &str, keys: Vec<Key>, start_after: Option<&str>, limit: usize) -> Self {
        let from = start_after.map_or(0, |after| keys.partition_point(|key| key.as_str() <= after));
        let direct = |key: &Key| key.as_str().strip_prefix(prefix).is_some_and(|name| !name.contains('/'));
        let mut keys: Vec<Key> = keys.into_iter().skip(from).filter(direct).take(limit + 1).collect();
        let more = keys.len() > limit;
        keys.truncate(limit);
        Self { keys, more }
    }
}

/// A stream of an object's bytes, read lazily.
pub type ByteStream = BoxStream<'static, Result<Bytes, StorageError>>;

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("object {0} not found")]
    NotFound(String),
    #[error("storage I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("object store request failed: {0}")]
    Backend(String),
    /// An object that does not read as what it should be (a record that does not
    /// decode): trying again reads the same bytes.
    #[error("corrupt object: {0}")]
    Corrupt(String),
}

#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Starts writing `key`; the object appears, whole, only when the writer finishes.
    async fn writer(&self, key: &Key) -> Result<Box<dyn ObjectWriter>, StorageError>;

    /// Streams the object, or the `range` of it (clamped to its end).
    async fn read(&self, key: &Key, range: Option<Range<u64>>) -> Result<ByteStream, StorageError>;

    /// The object's size, or `None` when it does not exist.
    async fn size(&self, key: &Key) -> Result<Option<u64>, StorageError>;

    /// Removes the object; removing a missing object is not an error.
    async fn delete(&self, key: &Key) -> Result<(), StorageError>;

    /// Every key that starts with `prefix`, in lexical order.
    async fn list(&self, prefix: &str) -> Result<Vec<Key>, StorageError>;

    /// The first `limit` keys directly in the directory `prefix` (ending in `/`; not in
    /// its subdirectories) that sort after `start_after`, in lexical order: what a listing
    /// endpoint pages through, at a cost in proportion to the page, not to the directory.
    async fn list_page(&self, prefix: &str, start_after: Option<&str>, limit: usize) -> Result<KeyPage, StorageError> {
        Ok(KeyPage::of_listing(prefix, self.list(prefix).await?, start_after, limit))
    }

    /// Removes what writers that never finished left behind (a process killed during an
    /// upload): the directory store's temp files not written to for `idle`, S3's multipart
    /// uploads started longer ago than [`ABANDONED_UPLOAD`]. Returns how many went.
    async fn sweep_abandoned(&self, _idle: std::time::Duration) -> Result<usize, StorageError> {
        Ok(0)
    }

    /// Whether this process is the store's only writer: a data directory is locked by the
    /// process that uses it, while S3 is shared by every pod. Fencing checks that a shard
    /// still belongs to a run only where another process could have claimed it.
    fn exclusive(&self) -> bool {
        false
    }

    /// Whether objects can be written in place ([`ObjectStore::write_at`]): a local
    /// directory can, S3 cannot. Workers then keep a journal per run, written at its end
    /// on every commit, instead of two new objects per commit.
    fn writes_in_place(&self) -> bool {
        false
    }

    /// Writes `bytes` at `offset` of `key`, creating it if needed; visible to readers at
    /// once (a reader may see part of it), durable against a crash of this process, and
    /// against power loss only after [`ObjectStore::sync`]. The same call may be made
    /// again after a failure.
    async fn write_at(&self, key: &Key, _offset: u64, _bytes: Bytes) -> Result<(), StorageError> {
        Err(StorageError::Backend(format!("{key}: this store cannot write in place")))
    }

    /// Makes what [`ObjectStore::write_at`] wrote to `key` durable against power loss.
    async fn sync(&self, _key: &Key) -> Result<(), StorageError> {
        Ok(())
    }

    /// Writes `dest` as the concatenation of `sources`, in order, and returns its size; a
    /// missing source is `NotFound` and leaves no `dest`. The default streams each source
    /// through a writer (memory: one writer's buffer); S3 copies server-side where its part
    /// sizes allow.
    async fn compose(&self, dest: &Key, sources: &[Key]) -> Result<u64, StorageError> {
        compose_by_streaming(self, dest, sources).await
    }

    /// Writes a small object only if `key` does not exist yet, atomically: of two calls
    /// at once (from any process), one returns `true`, the other `false` and writes
    /// nothing. What idempotency keys are claimed with.
    async fn create_exclusive(&self, key: &Key, _bytes: Bytes) -> Result<bool, StorageError> {
        Err(StorageError::Backend(format!("{key}: this store cannot create objects exclusively")))
    }

    /// Writes a small object in one call.
    async fn put(&self, key: &Key, bytes: Bytes) -> Result<(), StorageError> {
        let mut writer = self.writer(key).await?;
        writer.write(bytes).await?;
        writer.finish().await.map(drop)
    }

    /// Reads a small object whole.
    async fn get(&self, key: &Key) -> Result<Bytes, StorageError> {
        let mut stream = self.read(key, None).await?;
        let mut buffer = BytesMut::new();
        while let Some(chunk) = stream.next().await {
            buffer.extend_from_slice(&chunk?);
        }
        Ok(buffer.freeze())
    }
}

/// [`ObjectStore::compose`] by reading every source and writing it out again.
pub async fn compose_by_streaming<S: ObjectStore + ?Sized>(
    store: &S,
    dest: &Key,
    sources: &[Key],
) -> Result<u64, StorageError> {
    // An unfinished writer, dropped on an error, leaves nothing behind.
    let mut writer = store.writer(dest).await?;
    for source in sources {
        let mut stream = store.read(source, None).await?;
        while let Some(chunk) = stream.next().await {
            writer.write(chunk?).await?;
        }
    }
    writer.finish().await
}

#[async_trait]
pub trait ObjectWriter: Send {
    async fn write(&mut self, chunk: Bytes) -> Result<(), StorageError>;

    /// Publishes the object and returns its size.
    async fn finish(self: Box<Self>) -> Result<u64, StorageError>;

    /// Discards everything written. Dropping an unfinished writer does the same, as
    /// far as it can without awaiting.
    async fn abort(self: Box<Self>);
}
