//! Objects as files under a directory, laid out exactly as their keys.
//!
//! Writes land in `<root>/.tmp/` and are renamed into place once synced, so readers
//! see either no object or the whole one, also across a crash.

use std::io::SeekFrom;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use tokio::fs;
use tokio::io::{AsyncSeekExt, AsyncWriteExt, BufWriter};
use tokio_util::io::ReaderStream;

use super::dir_index::DirIndex;
use super::{ByteStream, Key, KeyPage, ObjectStore, ObjectWriter, StorageError};

const TMP_DIR: &str = ".tmp";
const READ_CHUNK: usize = 64 * 1024;
/// A write in place of at most this many bytes to a file that exists (a journal's next
/// frame) is made on the caller's thread, not handed to the blocking pool: it goes to
/// the page cache in microseconds, and a line's permit waits for it. At a 50-ms upstream
/// at 256 in flight the hand-off cost a short batch 3–4% of its pace (the pool's threads
/// are woken, or started, for every commit: one or a few lines each at that pace).
/// Larger frames (an instant upstream's groups, up to megabytes) still go to the pool.
const IN_PLACE_UP_TO: usize = 64 * 1024;

pub struct DirStore {
    root: PathBuf,
    index: Arc<DirIndex>,
}

impl DirStore {
    pub async fn open(root: impl Into<PathBuf>) -> Result<Self, StorageError> {
        let root = root.into();
        fs::create_dir_all(root.join(TMP_DIR)).await?;
        Ok(Self { root, index: Arc::default() })
    }

    fn path(&self, key: &Key) -> PathBuf {
        self.root.join(key.as_str())
    }
}

fn not_found_as_none<T>(result: std::io::Result<T>) -> std::io::Result<Option<T>> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error),
    }
}

#[async_trait]
impl ObjectStore for DirStore {
    async fn writer(&self, key: &Key) -> Result<Box<dyn ObjectWriter>, StorageError> {
        let temp = self.root.join(TMP_DIR).join(ulid::Ulid::new().to_string());
        let file = fs::File::create(&temp).await?;
        Ok(Box::new(DirWriter {
            file: Some(BufWriter::with_capacity(256 * 1024, file)),
            temp,
            target: self.path(key),
            key: key.clone(),
            index: self.index.clone(),
            written: 0,
        }))
    }

    async fn read(&self, key: &Key, range: Option<Range<u64>>) -> Result<ByteStream, StorageError> {
        let path = self.path(key);
        let mut file =
            not_found_as_none(fs::File::open(&path).await)?.ok_or_else(|| StorageError::NotFound(key.to_string()))?;
        let stream = match range {
            None => ReaderStream::with_capacity(file, READ_CHUNK).map_err(StorageError::from).boxed(),
            Some(range) => {
                file.seek(SeekFrom::Start(range.start)).await?;
                let limited = tokio::io::AsyncReadExt::take(file, range.end.saturating_sub(range.start));
                ReaderStream::with_capacity(limited, READ_CHUNK).map_err(StorageError::from).boxed()
            }
        };
        Ok(stream)
    }

    async fn put(&self, key: &Key, bytes: Bytes) -> Result<(), StorageError> {
        // One blocking call for a small object (a commit's chunk or checkpoint), not one
        // per step: commits come back to back while lines wait for them.
        let temp = self.root.join(TMP_DIR).join(ulid::Ulid::new().to_string());
        let target = self.path(key);
        tokio::task::spawn_blocking(move || put_file(&temp, &target, &bytes))
            .await
            .map_err(|error| StorageError::Backend(format!("a blocking write panicked: {error}")))??;
        self.index.added(key).await;
        Ok(())
    }

    /// Written aside, then hard-linked into place: a link never replaces a file.
    async fn create_exclusive(&self, key: &Key, bytes: Bytes) -> Result<bool, StorageError> {
        let temp = self.root.join(TMP_DIR).join(ulid::Ulid::new().to_string());
        let target = self.path(key);
        let created = tokio::task::spawn_blocking(move || create_file_exclusive(&temp, &target, &bytes))
            .await
            .map_err(|error| StorageError::Backend(format!("a blocking write panicked: {error}")))??;
        if created {
            self.index.added(key).await;
        }
        Ok(created)
    }

    fn exclusive(&self) -> bool {
        true
    }

    fn writes_in_place(&self) -> bool {
        true
    }

    async fn write_at(&self, key: &Key, offset: u64, bytes: Bytes) -> Result<(), StorageError> {
        let path = self.path(key);
        if offset > 0 && bytes.len() <= IN_PLACE_UP_TO {
            return Ok(write_file_at(&path, offset, &bytes)?);
        }
        tokio::task::spawn_blocking(move || write_file_at(&path, offset, &bytes))
            .await
            .map_err(|error| StorageError::Backend(format!("a blocking write panicked: {error}")))??;
        if offset == 0 {
            self.index.added(key).await;
        }
        Ok(())
    }

    async fn sync(&self, key: &Key) -> Result<(), StorageError> {
        let path = self.path(key);
        tokio::task::spawn_blocking(move || std::fs::OpenOptions::new().write(true).open(path)?.sync_data())
            .await
            .map_err(|error| StorageError::Backend(format!("a blocking sync panicked: {error}")))??;
        Ok(())
    }

    async fn get(&self, key: &Key) -> Result<Bytes, StorageError> {
        // One blocking call for a small object, not one per step of a stream.
        let bytes = not_found_as_none(fs::read(self.path(key)).await)?;
        Ok(Bytes::from(bytes.ok_or_else(|| StorageError::NotFound(key.to_string()))?))
    }

    async fn size(&self, key: &Key) -> Result<Option<u64>, StorageError> {
        let metadata = not_found_as_none(fs::metadata(self.path(key)).await)?;
        Ok(metadata.filter(|m| m.is_file()).map(|m| m.len()))
    }

    async fn sweep_abandoned(&self, idle: std::time::Duration) -> Result<usize, StorageError> {
        let mut removed = 0;
        let mut entries = fs::read_dir(self.root.join(TMP_DIR)).await?;
        while let Some(entry) = entries.next_entry().await? {
            let Ok(modified) = entry.metadata().await.and_then(|m| m.modified()) else { continue };
            if modified.elapsed().unwrap_or_default() >= idle {
                not_found_as_none(fs::remove_file(entry.path()).await)?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    async fn delete(&self, key: &Key) -> Result<(), StorageError> {
        not_found_as_none(fs::remove_file(self.path(key)).await)?;
        self.index.removed(key).await;
        Ok(())
    }

    async fn list_page(&self, prefix: &str, start_after: Option<&str>, limit: usize) -> Result<KeyPage, StorageError> {
        match prefix.strip_suffix('/') {
            Some(dir) if Key::parse(dir).is_some() => self.index.page(&self.root, dir, start_after, limit).await,
            _ => Ok(KeyPage::of_listing(prefix, self.list(prefix).await?, start_after, limit)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Key>, StorageError> {
        let (root, prefix) = (self.root.clone(), prefix.to_owned());
        tokio::task::spawn_blocking(move || list_files(&root, &prefix))
            .await
            .map_err(|error| StorageError::Backend(format!("a blocking listing panicked: {error}")))?
            .map_err(StorageError::from)
    }
}

struct DirWriter {
    file: Option<BufWriter<fs::File>>,
    temp: PathBuf,
    target: PathBuf,
    key: Key,
    index: Arc<DirIndex>,
    written: u64,
}

impl DirWriter {
    fn file(&mut self) -> &mut BufWriter<fs::File> {
        self.file.as_mut().expect("writer used after finish")
    }
}

/// Writes `bytes` at `offset` of the file at `path`, creating it (and its directory).
fn write_file_at(path: &Path, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let open = || std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path);
    let file = match open() {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(path.parent().expect("keys have a parent"))?;
            open()?
        }
        other => other?,
    };
    file.write_all_at(bytes, offset)
}

/// Writes `bytes` to `temp`, syncs it and renames it to `target`; removes `temp` on failure.
/// Writes `bytes` to `temp`, synced, then `place`s it at `target` (a rename, or a hard
/// link that never replaces a file), making the target's directory when it is missing.
/// `temp` is removed on a failure; a link leaves it for the caller.
fn write_then_place(
    temp: &Path,
    target: &Path,
    bytes: &[u8],
    place: fn(&Path, &Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let result = (|| {
        let mut file = std::fs::File::create(temp)?;
        std::io::Write::write_all(&mut file, bytes)?;
        file.sync_all()?;
        drop(file);
        match place(temp, target) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(target.parent().expect("keys have a parent"))?;
                place(temp, target)
            }
            other => other,
        }
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(temp);
    }
    result
}

fn put_file(temp: &Path, target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_then_place(temp, target, bytes, |temp, target| std::fs::rename(temp, target))
}

fn create_file_exclusive(temp: &Path, target: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    let linked = write_then_place(temp, target, bytes, |temp, target| std::fs::hard_link(temp, target));
    match linked {
        Ok(()) => {
            let _ = std::fs::remove_file(temp);
            Ok(true)
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(error) => Err(error),
    }
}

/// The keys of the files under `root` that start with `prefix`, sorted, walking only
/// the deepest directory the prefix names in full.
fn list_files(root: &Path, prefix: &str) -> std::io::Result<Vec<Key>> {
    let start = match prefix.rfind('/') {
        Some(slash) => &prefix[..slash],
        None => "",
    };
    let mut keys = Vec::new();
    let mut pending = vec![(root.join(start), start.to_owned())];
    while let Some((dir, relative)) = pending.pop() {
        let Some(entries) = not_found_as_none(std::fs::read_dir(&dir))? else {
            continue;
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') {
                continue;
            }
            let key = if relative.is_empty() { name.to_owned() } else { format!("{relative}/{name}") };
            if entry.file_type()?.is_dir() {
                if prefix.starts_with(&key) || key.starts_with(prefix) {
                    pending.push((entry.path(), key));
                }
            } else if key.starts_with(prefix)
                && let Some(key) = Key::parse(&key)
            {
                keys.push(key);
            }
        }
    }
    keys.sort();
    Ok(keys)
}

async fn publish(temp: &Path, target: &Path) -> std::io::Result<()> {
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).await?;
    }
    fs::rename(temp, target).await
}

#[async_trait]
impl ObjectWriter for DirWriter {
    async fn write(&mut self, chunk: Bytes) -> Result<(), StorageError> {
        self.file().write_all(&chunk).await?;
        self.written += chunk.len() as u64;
        Ok(())
    }

    async fn finish(mut self: Box<Self>) -> Result<u64, StorageError> {
        let mut file = self.file.take().expect("writer used after finish");
        let result = async {
            file.flush().await?;
            file.get_ref().sync_all().await?;
            drop(file);
            publish(&self.temp, &self.target).await
        }
        .await;
        if let Err(error) = result {
            let _ = fs::remove_file(&self.temp).await;
            return Err(error.into());
        }
        self.index.added(&self.key).await;
        Ok(self.written)
    }

    async fn abort(mut self: Box<Self>) {
        self.file.take();
        let _ = fs::remove_file(&self.temp).await;
    }
}

impl Drop for DirWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            // Abandoned mid-write (a dropped request, a panic): remove the partial file.
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A journal's frames, whichever way each is written (the first and a large one by
    /// the blocking pool, small ones in place): every byte lands at its offset, a frame
    /// written again (a retried commit) changes nothing, and the object is listed once.
    #[tokio::test]
    async fn frames_written_in_place_or_by_the_pool_make_one_object() {
        let root = tempfile::TempDir::new().unwrap();
        let store = DirStore::open(root.path()).await.unwrap();
        let key = Key::from_segments(&["batches", "b1", "journal", "w1"]);
        let frames = [vec![1u8; 100], vec![2; 10], vec![3; IN_PLACE_UP_TO + 1], vec![4; 20]];
        let mut at = 0;
        for frame in &frames {
            store.write_at(&key, at, Bytes::from(frame.clone())).await.unwrap();
            store.write_at(&key, at, Bytes::from(frame.clone())).await.unwrap();
            at += frame.len() as u64;
        }
        assert_eq!(store.get(&key).await.unwrap(), frames.concat());
        let listed = store.list("batches/b1/").await.unwrap();
        assert_eq!(listed.iter().filter(|listed| **listed == key).count(), 1, "{listed:?}");
    }
}
