//! The file catalog: records and bytes of every project's files in object storage.
//!
//! Layout: `file-meta/<project>/<file id>.json` holds the [`FileRecord`];
//! `file-data/<project>/<file id>` holds the bytes; `file-newest/<project>/<marker>` is
//! an empty marker per live file, for listing newest first ([`newest_first`]). The bytes
//! are written first, then the marker, and the record last, so a record always points
//! at complete bytes; listing and lookup go through records only (a marker without a
//! record is skipped). Ids are time-sortable, so key order is creation order, and a page
//! costs in proportion to its size (plus the deleted or other-purpose files it skips).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::record::{FileRecord, Purpose};
use crate::clock::{self, UnixSeconds};
use crate::ids::{FileId, ProjectId};
use crate::storage::{ByteStream, Key, ObjectStore, ObjectWriter, StorageError, newest_first, read_page};

/// The index of live files, newest first.
const NEWEST: &str = "file-newest";

#[derive(Clone)]
pub struct FileCatalog {
    store: Arc<dyn ObjectStore>,
    retention: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Asc,
    Desc,
}

#[derive(Clone, Debug)]
pub struct FileListQuery {
    pub purpose: Option<String>,
    pub order: Order,
    pub after: Option<String>,
    pub limit: usize,
}

#[derive(Debug)]
pub struct FilePage {
    pub records: Vec<FileRecord>,
    pub has_more: bool,
}

/// How a finished upload is to be recorded.
#[derive(Clone, Debug)]
pub struct NewFile {
    pub filename: Option<String>,
    pub purpose: Purpose,
    pub is_error: bool,
    /// When it expires, if not after the catalog's retention.
    pub expires_after: Option<super::ExpiresAfter>,
}

fn meta_key(project: &ProjectId, id: &FileId) -> Key {
    Key::from_segments(&["file-meta", project.as_str(), &format!("{id}.json")])
}

fn data_key(project: &ProjectId, id: &FileId) -> Key {
    Key::from_segments(&["file-data", project.as_str(), id.as_str()])
}

fn marker_key(project: &ProjectId, id: &FileId) -> Key {
    newest_first::marker(NEWEST, project.as_str(), id.as_str()).expect("file ids are marker-safe")
}

/// The file a listed key names: a record key (oldest first) or a marker (newest first).
fn listed_id(key: &Key, order: Order) -> Option<FileId> {
    match order {
        Order::Asc => key.name().strip_suffix(".json").and_then(FileId::parse),
        Order::Desc => newest_first::id(key.name()).as_deref().and_then(FileId::parse),
    }
}

fn decode(bytes: &[u8]) -> Result<FileRecord, StorageError> {
    serde_json::from_slice(bytes).map_err(|e| StorageError::Corrupt(format!("unreadable file record: {e}")))
}

impl FileCatalog {
    pub fn new(store: Arc<dyn ObjectStore>, retention: Duration) -> Self {
        Self { store, retention }
    }

    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Opens a new file's bytes for writing. Nothing is visible until [`Upload::commit`].
    pub async fn start_upload(&self, project: &ProjectId) -> Result<Upload, StorageError> {
        self.start_upload_with_id(project, FileId::generate()).await
    }

    /// As [`FileCatalog::start_upload`], under an id chosen beforehand (finalize
    /// reserves its ids, so a finalize that is run again rewrites the same files).
    pub async fn start_upload_with_id(&self, project: &ProjectId, id: FileId) -> Result<Upload, StorageError> {
        let writer = self.store.writer(&data_key(project, &id)).await?;
        Ok(Upload { catalog: self.clone(), project: project.clone(), id, writer, bytes: 0 })
    }

    async fn read_record(&self, project: &ProjectId, id: &FileId) -> Result<Option<FileRecord>, StorageError> {
        match self.store.get(&meta_key(project, id)).await {
            Ok(bytes) => decode(&bytes).map(Some),
            Err(StorageError::NotFound(_)) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// The project's file with this id, whatever its state (deleted and expired ones too,
    /// until collected).
    pub async fn record(&self, project: &ProjectId, id: &FileId) -> Result<Option<FileRecord>, StorageError> {
        self.read_record(project, id).await
    }

    /// The project's live file with this id, in either spelling of the prefix.
    pub async fn find(&self, project: &ProjectId, raw_id: &str) -> Result<Option<FileRecord>, StorageError> {
        let Some(id) = FileId::parse(raw_id) else {
            return Ok(None);
        };
        let now = clock::now();
        for candidate in [id.clone(), id.other_spelling()] {
            if let Some(record) = self.read_record(project, &candidate).await? {
                return Ok(record.is_live(now).then_some(record));
            }
        }
        Ok(None)
    }

    /// The file's bytes; `NotFound` when the record exists but the bytes are gone.
    pub async fn open(&self, record: &FileRecord) -> Result<ByteStream, StorageError> {
        self.store.read(&data_key(&record.project_id, &record.id), None).await
    }

    /// A byte range of a file's bytes by id, whatever its record says: running batches
    /// read their input this way, so deleting an input does not stop them.
    pub async fn open_data_range(
        &self,
        project: &ProjectId,
        id: &FileId,
        range: std::ops::Range<u64>,
    ) -> Result<ByteStream, StorageError> {
        self.store.read(&data_key(project, id), Some(range)).await
    }

    /// A page of the project's live files. A cursor need not exist any more: the page
    /// starts from where it would sort.
    pub async fn list(&self, project: &ProjectId, query: &FileListQuery) -> Result<FilePage, StorageError> {
        let (prefix, cursor) = match query.order {
            Order::Asc => {
                let prefix = format!("file-meta/{project}/");
                let cursor = query.after.as_ref().map(|after| format!("{prefix}{after}.json"));
                (prefix, cursor)
            }
            Order::Desc => {
                let prefix = newest_first::prefix(NEWEST, project.as_str());
                let cursor = query.after.as_ref().map(|after| match newest_first::name(after) {
                    Some(name) => format!("{prefix}{name}"),
                    // Not an id: no file sorts after it, newest first.
                    None => format!("{prefix}~"),
                });
                (prefix, cursor)
            }
        };
        let now = clock::now();
        let wanted = |record: &FileRecord| {
            record.is_live(now) && query.purpose.as_deref().is_none_or(|purpose| purpose == record.purpose.as_str())
        };
        let (records, has_more) = read_page(self.store.as_ref(), &prefix, cursor, query.limit, |key| async move {
            let Some(id) = listed_id(&key, query.order) else { return Ok(None) };
            Ok::<_, StorageError>(self.read_record(project, &id).await?.filter(wanted))
        })
        .await?;
        Ok(FilePage { records, has_more })
    }

    /// Marks the file deleted; its bytes go at the next garbage collection.
    /// Returns `None` when there is no such live file.
    pub async fn delete(&self, project: &ProjectId, raw_id: &str) -> Result<Option<FileRecord>, StorageError> {
        let Some(mut record) = self.find(project, raw_id).await? else {
            return Ok(None);
        };
        record.deleted_at = Some(clock::now());
        self.write_record(&record).await?;
        // The record says deleted already: a crash here leaves a marker that listings skip
        // and garbage collection removes.
        self.store.delete(&marker_key(project, &record.id)).await?;
        Ok(Some(record))
    }

    /// Makes a file of the concatenation of `parts` (keys in this store), under `id`: what
    /// completing an Upload does. Run again with the same arguments, it writes the same
    /// file again.
    pub async fn assemble(
        &self,
        project: &ProjectId,
        id: FileId,
        parts: &[Key],
        file: NewFile,
    ) -> Result<FileRecord, StorageError> {
        let bytes = self.store.compose(&data_key(project, &id), parts).await?;
        self.publish(project.clone(), id, bytes, file).await
    }

    /// Writes the marker and then the record of a file whose bytes are in place; on a
    /// failure, removes what it wrote and the bytes.
    async fn publish(
        &self,
        project: ProjectId,
        id: FileId,
        bytes: u64,
        file: NewFile,
    ) -> Result<FileRecord, StorageError> {
        let created_at = clock::now();
        let record = FileRecord {
            filename: file.filename.filter(|name| !name.is_empty()).unwrap_or_else(|| format!("{id}.jsonl")),
            id,
            project_id: project,
            bytes,
            created_at,
            purpose: file.purpose,
            expires_at: Some(
                created_at + file.expires_after.map_or(self.retention.as_secs(), |after| after.seconds) as i64,
            ),
            is_error: file.is_error,
            deleted_at: None,
        };
        let marker = marker_key(&record.project_id, &record.id);
        let published = async {
            self.store.put(&marker, Bytes::new()).await?;
            self.write_record(&record).await
        };
        if let Err(error) = published.await {
            let _ = self.store.delete(&marker).await;
            let _ = self.store.delete(&data_key(&record.project_id, &record.id)).await;
            return Err(error);
        }
        Ok(record)
    }

    async fn write_record(&self, record: &FileRecord) -> Result<(), StorageError> {
        let json = serde_json::to_vec(record).expect("file records serialize");
        self.store.put(&meta_key(&record.project_id, &record.id), Bytes::from(json)).await
    }

    /// Removes what writers that never finished left in storage.
    pub async fn sweep_abandoned(&self) -> Result<usize, StorageError> {
        self.store.sweep_abandoned(crate::storage::ABANDONED_AFTER).await
    }

    /// Removes the bytes, marker and record of every deleted or expired file but the
    /// `pinned` ones (inputs of running batches), and returns how many files went. Also
    /// puts back the marker of a live file that has none (a file from before markers), and
    /// removes a marker whose file never got its record (an upload killed in between).
    pub async fn collect_garbage(&self, now: UnixSeconds, pinned: &HashSet<FileId>) -> Result<usize, StorageError> {
        let mut markers: HashSet<Key> = self.store.list(&format!("{NEWEST}/")).await?.into_iter().collect();
        let mut removed = 0;
        for key in self.store.list("file-meta/").await? {
            let record = match self.store.get(&key).await {
                Ok(bytes) => decode(&bytes)?,
                Err(StorageError::NotFound(_)) => continue,
                Err(error) => return Err(error),
            };
            let marker = marker_key(&record.project_id, &record.id);
            let marked = markers.remove(&marker);
            if record.is_live(now) {
                if !marked {
                    self.store.put(&marker, Bytes::new()).await?;
                }
                continue;
            }
            if pinned.contains(&record.id) {
                continue;
            }
            // Bytes first, record last: a crash in between leaves a dead record, swept next time.
            self.store.delete(&data_key(&record.project_id, &record.id)).await?;
            if marked {
                self.store.delete(&marker).await?;
            }
            self.store.delete(&key).await?;
            removed += 1;
        }
        // What is left marks no record: an upload between the two, or one killed there.
        let abandoned_before = now.saturating_sub(crate::storage::ABANDONED_AFTER.as_secs() as i64);
        for marker in markers {
            let created =
                newest_first::id(marker.name()).as_deref().and_then(FileId::parse).and_then(|id| id.created_at());
            if created.is_none_or(|created| created < abandoned_before) {
                self.store.delete(&marker).await?;
            }
        }
        Ok(removed)
    }
}

/// A file being written. Dropping it without [`Upload::commit`] leaves nothing behind.
pub struct Upload {
    catalog: FileCatalog,
    project: ProjectId,
    id: FileId,
    writer: Box<dyn ObjectWriter>,
    bytes: u64,
}

impl Upload {
    pub fn id(&self) -> &FileId {
        &self.id
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub async fn write(&mut self, chunk: Bytes) -> Result<(), StorageError> {
        self.bytes += chunk.len() as u64;
        self.writer.write(chunk).await
    }

    pub async fn abort(self) {
        self.writer.abort().await;
    }

    /// Publishes the bytes, then the record that makes the file visible.
    pub async fn commit(self, file: NewFile) -> Result<FileRecord, StorageError> {
        let bytes = self.writer.finish().await?;
        self.catalog.publish(self.project, self.id, bytes, file).await
    }
}
