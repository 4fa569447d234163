//! The directory store's index of listed directories: the sorted names of the objects in
//! each directory that was paged through, kept in step with every write and removal, so
//! that a page costs a range lookup instead of reading (and sorting) the whole directory.
//!
//! A directory is read once, on its first page; the store's process owns the data
//! directory (`serve` locks it), so nothing else changes it behind the index.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tokio::fs;
use tokio::sync::Mutex;

use super::{Key, KeyPage, StorageError};

#[derive(Default)]
pub(super) struct DirIndex {
    /// Directory key (no trailing slash) → the names of the objects in it.
    dirs: Mutex<HashMap<String, BTreeSet<String>>>,
}

fn split(key: &Key) -> (&str, &str) {
    key.as_str().rsplit_once('/').unwrap_or(("", key.as_str()))
}

impl DirIndex {
    /// Records that `key` now exists (it was just published).
    pub(super) async fn added(&self, key: &Key) {
        let (dir, name) = split(key);
        if let Some(names) = self.dirs.lock().await.get_mut(dir) {
            names.insert(name.to_owned());
        }
    }

    /// Records that `key` is gone.
    pub(super) async fn removed(&self, key: &Key) {
        let (dir, name) = split(key);
        if let Some(names) = self.dirs.lock().await.get_mut(dir) {
            names.remove(name);
        }
    }

    /// A page of the directory `dir` (a key prefix without its trailing slash) under
    /// `root`. The lock is held while a directory is first read, so a write that
    /// publishes meanwhile either is seen by the read or updates the index after it.
    pub(super) async fn page(
        &self,
        root: &Path,
        dir: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, StorageError> {
        let mut dirs = self.dirs.lock().await;
        if !dirs.contains_key(dir) {
            let names = read_names(&root.join(dir)).await?;
            dirs.insert(dir.to_owned(), names);
        }
        let names = &dirs[dir];
        let slashed = format!("{dir}/");
        let after = start_after.map(|after| match after.strip_prefix(&slashed) {
            Some(name) => name.to_owned(),
            // A cursor outside the directory sorts before all of it or after all of it.
            None if after < slashed.as_str() => String::new(),
            None => char::MAX.to_string(),
        });
        let range = match &after {
            Some(after) => {
                names.range::<str, _>((std::ops::Bound::Excluded(after.as_str()), std::ops::Bound::Unbounded))
            }
            None => names.range::<str, _>(..),
        };
        let mut keys: Vec<Key> =
            range.take(limit + 1).filter_map(|name| Key::parse(&format!("{dir}/{name}"))).collect();
        let more = keys.len() > limit;
        keys.truncate(limit);
        Ok(KeyPage { keys, more })
    }
}

/// The names of the objects (not subdirectories, not hidden files) in `path`.
async fn read_names(path: &Path) -> Result<BTreeSet<String>, StorageError> {
    let mut names = BTreeSet::new();
    let mut entries = match fs::read_dir(path).await {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(names),
        Err(error) => return Err(error.into()),
    };
    while let Some(entry) = entries.next_entry().await? {
        let Ok(name) = entry.file_name().into_string() else { continue };
        if !name.starts_with('.') && entry.file_type().await?.is_file() {
            names.insert(name);
        }
    }
    Ok(names)
}
