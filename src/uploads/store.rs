//! Uploads and their parts in object storage, and the file a completion assembles.
//!
//! Layout: `uploads/<project>/<upload id>.json` holds the [`UploadRecord`];
//! `upload-parts/<project>/<upload id>/<part id>` a part's bytes, streamed as they arrive
//! (never held whole), and next to it `<part id>.size=<bytes>`, an empty object written
//! once the bytes are whole. So one listing of the upload's directory tells which parts
//! exist and their sizes, and a part cut off mid-way does not exist.

use std::collections::HashMap;

use bytes::Bytes;
use futures_util::StreamExt;
use md5::{Digest, Md5};

use super::record::{PartObject, UploadRecord, UploadStatus};
use super::request::{CompleteUpload, NewUpload};
use super::tally::{PartSlot, Tallies, Tally};
use super::{MAX_PART_BYTES, MAX_PARTS, UPLOAD_LIFETIME_SECONDS};
use crate::clock::UnixSeconds;
use crate::files::{FileCatalog, FileRecord, NewFile};
use crate::ids::{PartId, ProjectId, UploadId};
use crate::storage::{Key, ObjectStore, ObjectWriter, StorageError};

/// A pending upload past its hour keeps its parts this much longer, so that a completion
/// that began just before the hour was up is not cut from under it.
const EXPIRED_PARTS_GRACE: i64 = 600;
/// How long after its hour an upload's record stays, so that a client retrying a
/// completion or a cancel gets the answer instead of a 404.
const RECORD_KEPT_SECONDS: i64 = 24 * 3600;
const SIZE_MARK: &str = ".size=";

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("No such upload: {0}")]
    NotFound(String),
    #[error("Upload {id} has expired: an upload accepts parts and completion for an hour after it is created")]
    Expired { id: UploadId },
    #[error("Upload {id} is already {}", status.as_str())]
    NotPending { id: UploadId, status: UploadStatus },
    #[error("A part may hold at most {MAX_PART_BYTES} bytes (64 MB)")]
    PartTooLarge,
    #[error("The part is empty")]
    EmptyPart,
    #[error("Upload {id} already has {MAX_PARTS} parts, the most an upload may have")]
    TooManyParts { id: UploadId },
    #[error("The parts of upload {id} would hold more than the {bytes} bytes it was created with")]
    OverSize { id: UploadId, bytes: u64 },
    #[error("No part {part} was added to upload {id}")]
    UnknownPart { id: UploadId, part: String },
    #[error("The parts hold {got} bytes, but upload {id} was created with bytes={bytes}")]
    SizeMismatch { id: UploadId, bytes: u64, got: u64 },
    #[error("The MD5 of the parts is {got}, not the md5 given ({expected})")]
    Md5Mismatch { expected: String, got: String },
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// The record, if it still takes parts and completion at `now`; else why not.
fn still_pending(record: UploadRecord, now: UnixSeconds) -> Result<UploadRecord, UploadError> {
    match record.status_at(now) {
        UploadStatus::Pending => Ok(record),
        UploadStatus::Expired => Err(UploadError::Expired { id: record.id }),
        status => Err(UploadError::NotPending { id: record.id, status }),
    }
}

fn record_key(project: &ProjectId, id: &UploadId) -> Key {
    Key::from_segments(&["uploads", project.as_str(), &format!("{id}.json")])
}

fn parts_prefix(project: &ProjectId, id: &UploadId) -> String {
    format!("upload-parts/{project}/{id}/")
}

fn part_key(project: &ProjectId, id: &UploadId, part: &PartId) -> Key {
    Key::from_segments(&["upload-parts", project.as_str(), id.as_str(), part.as_str()])
}

fn size_key(project: &ProjectId, id: &UploadId, part: &PartId, bytes: u64) -> Key {
    Key::from_segments(&["upload-parts", project.as_str(), id.as_str(), &format!("{part}{SIZE_MARK}{bytes}")])
}

/// The finished parts among an upload's keys, with their sizes.
fn finished_parts(keys: &[Key]) -> HashMap<String, u64> {
    keys.iter()
        .filter_map(|key| {
            let (part, size) = key.name().split_once(SIZE_MARK)?;
            Some((part.to_owned(), size.parse().ok()?))
        })
        .collect()
}

#[derive(Clone)]
pub struct UploadStore {
    files: FileCatalog,
    /// What each pending upload holds, so that a part begins without a listing.
    tallies: Tallies,
}

impl UploadStore {
    pub fn new(files: FileCatalog) -> Self {
        Self { files, tallies: Tallies::default() }
    }

    fn store(&self) -> &dyn ObjectStore {
        self.files.store().as_ref()
    }

    pub async fn create(
        &self,
        project: &ProjectId,
        new: NewUpload,
        now: UnixSeconds,
    ) -> Result<UploadRecord, UploadError> {
        let record = UploadRecord {
            id: UploadId::generate(),
            project_id: project.clone(),
            filename: new.filename,
            purpose: new.purpose,
            bytes: new.bytes,
            mime_type: new.mime_type,
            created_at: now,
            expires_at: now + UPLOAD_LIFETIME_SECONDS,
            status: UploadStatus::Pending,
            file_expires_after: new.expires_after.map(|after| after.seconds),
            part_ids: Vec::new(),
        };
        self.write(&record).await?;
        Ok(record)
    }

    async fn write(&self, record: &UploadRecord) -> Result<(), StorageError> {
        let json = serde_json::to_vec(record).expect("upload records serialize");
        self.store().put(&record_key(&record.project_id, &record.id), Bytes::from(json)).await
    }

    /// The project's upload with this id, whatever its status.
    pub async fn find(&self, project: &ProjectId, raw_id: &str) -> Result<UploadRecord, UploadError> {
        let not_found = || UploadError::NotFound(raw_id.to_owned());
        let id = UploadId::parse(raw_id).ok_or_else(not_found)?;
        match self.store().get(&record_key(project, &id)).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StorageError::Corrupt(format!("unreadable upload record {id}: {e}")).into()),
            Err(StorageError::NotFound(_)) => Err(not_found()),
            Err(error) => Err(error.into()),
        }
    }

    /// The upload, if it still takes parts and completion at `now`.
    async fn pending(&self, project: &ProjectId, raw_id: &str, now: UnixSeconds) -> Result<UploadRecord, UploadError> {
        still_pending(self.find(project, raw_id).await?, now)
    }

    async fn part_keys(&self, record: &UploadRecord) -> Result<Vec<Key>, StorageError> {
        self.store().list(&parts_prefix(&record.project_id, &record.id)).await
    }

    /// Opens a new part of a pending upload for writing, with room for what the upload's
    /// size leaves after the parts it has.
    pub async fn start_part(
        &self,
        project: &ProjectId,
        raw_id: &str,
        now: UnixSeconds,
    ) -> Result<PartWriter, UploadError> {
        let record = self.pending(project, raw_id, now).await?;
        if self.tallies.get(&record.id).is_none() {
            let parts = finished_parts(&self.part_keys(&record).await?);
            let bytes = parts.values().sum();
            self.tallies.learn(&record.id, Tally { parts: parts.len(), bytes, expires_at: record.expires_at });
        }
        let (room, slot) = self
            .tallies
            .begin(&record.id, MAX_PARTS, record.bytes)
            .map_err(|_| UploadError::TooManyParts { id: record.id.clone() })?;
        let id = PartId::generate();
        let writer = self.store().writer(&part_key(project, &record.id, &id)).await?;
        Ok(PartWriter { store: self.clone(), room, record, id, writer, slot, written: 0, created_at: now })
    }

    /// Assembles the parts, in the order given, into the upload's file. The same
    /// completion sent again answers as the first did; two at once write the same file.
    pub async fn complete(
        &self,
        project: &ProjectId,
        raw_id: &str,
        request: CompleteUpload,
        now: UnixSeconds,
    ) -> Result<(UploadRecord, Option<FileRecord>), UploadError> {
        let record = self.find(project, raw_id).await?;
        let same_parts = record.part_ids.iter().map(PartId::as_str).eq(request.part_ids.iter().map(String::as_str));
        if record.status == UploadStatus::Completed && same_parts {
            let file = self.files.find(project, record.file_id().as_str()).await?;
            return Ok((record, file));
        }
        let mut record = still_pending(record, now)?;
        let sizes = finished_parts(&self.part_keys(&record).await?);
        let mut parts = Vec::with_capacity(request.part_ids.len());
        let mut total = 0;
        for raw_part in &request.part_ids {
            let (Some(part), Some(size)) = (PartId::parse(raw_part), sizes.get(raw_part.as_str())) else {
                return Err(UploadError::UnknownPart { id: record.id, part: raw_part.clone() });
            };
            total += size;
            parts.push(part);
        }
        if total != record.bytes {
            return Err(UploadError::SizeMismatch { id: record.id, bytes: record.bytes, got: total });
        }
        let keys: Vec<Key> = parts.iter().map(|part| part_key(project, &record.id, part)).collect();
        if let Some(expected) = request.md5 {
            let got = self.md5(&keys).await?;
            if got != expected {
                return Err(UploadError::Md5Mismatch { expected, got });
            }
        }
        let new = NewFile {
            filename: Some(record.filename.clone()),
            purpose: record.purpose,
            is_error: false,
            expires_after: record.file_expires_after.map(|seconds| crate::files::ExpiresAfter { seconds }),
        };
        let file = match self.files.assemble(project, record.file_id(), &keys, new).await {
            Ok(file) => file,
            // A completion at the same time finished first and dropped the parts: its
            // answer is ours.
            Err(StorageError::NotFound(missing)) => {
                let done = self.find(project, raw_id).await?;
                if done.status == UploadStatus::Completed && done.part_ids == parts {
                    let file = self.files.find(project, done.file_id().as_str()).await?;
                    return Ok((done, file));
                }
                // Still pending: a part went from under it (not a completion's doing).
                still_pending(done, now)?;
                return Err(StorageError::NotFound(missing).into());
            }
            Err(error) => return Err(error.into()),
        };
        record.status = UploadStatus::Completed;
        record.part_ids = parts;
        self.write(&record).await?;
        self.tallies.forget(&record.id);
        self.drop_parts(&record).await;
        Ok((record, Some(file)))
    }

    async fn md5(&self, keys: &[Key]) -> Result<String, StorageError> {
        let mut hasher = Md5::new();
        for key in keys {
            let mut stream = self.store().read(key, None).await?;
            while let Some(chunk) = stream.next().await {
                hasher.update(&chunk?);
            }
        }
        Ok(hex::encode(hasher.finalize()))
    }

    /// Cancels a pending upload (a cancelled one stays so) and drops its parts.
    pub async fn cancel(
        &self,
        project: &ProjectId,
        raw_id: &str,
        now: UnixSeconds,
    ) -> Result<UploadRecord, UploadError> {
        let mut record = self.find(project, raw_id).await?;
        match record.status_at(now) {
            UploadStatus::Pending => {}
            UploadStatus::Cancelled => return Ok(record),
            UploadStatus::Expired => return Err(UploadError::Expired { id: record.id }),
            status => return Err(UploadError::NotPending { id: record.id, status }),
        }
        record.status = UploadStatus::Cancelled;
        self.write(&record).await?;
        self.tallies.forget(&record.id);
        self.drop_parts(&record).await;
        Ok(record)
    }

    /// Best effort: what is left is collected as garbage.
    async fn drop_parts(&self, record: &UploadRecord) {
        if let Err(error) = self.delete_parts(&record.project_id, &record.id).await {
            tracing::warn!(upload = %record.id, %error, "could not drop an upload's parts; garbage collection will");
        }
    }

    async fn delete_parts(&self, project: &ProjectId, id: &UploadId) -> Result<(), StorageError> {
        for key in self.store().list(&parts_prefix(project, id)).await? {
            self.store().delete(&key).await?;
        }
        Ok(())
    }

    /// Drops the parts of finished and expired uploads, the records of uploads a day
    /// past their hour, and parts whose upload has no record; returns how many uploads
    /// it cleared.
    pub async fn collect_garbage(&self, now: UnixSeconds) -> Result<usize, StorageError> {
        self.tallies.forget_expired(now);
        let mut cleared = 0;
        let mut recorded = std::collections::HashSet::new();
        for key in self.store().list("uploads/").await? {
            let record: UploadRecord = match self.store().get(&key).await {
                Ok(bytes) => match serde_json::from_slice(&bytes) {
                    Ok(record) => record,
                    Err(error) => {
                        tracing::warn!(%key, %error, "skipping an unreadable upload record");
                        continue;
                    }
                },
                Err(StorageError::NotFound(_)) => continue,
                Err(error) => return Err(error),
            };
            let finished = record.status != UploadStatus::Pending || now >= record.expires_at + EXPIRED_PARTS_GRACE;
            if finished {
                self.delete_parts(&record.project_id, &record.id).await?;
            }
            if now >= record.expires_at + RECORD_KEPT_SECONDS {
                self.store().delete(&key).await?;
                cleared += 1;
            } else {
                recorded.insert(record.id);
            }
        }
        let orphaned_before = now - UPLOAD_LIFETIME_SECONDS - RECORD_KEPT_SECONDS;
        for key in self.store().list("upload-parts/").await? {
            let upload = key.as_str().split('/').nth(2).and_then(UploadId::parse);
            let orphaned = upload.is_some_and(|upload| {
                !recorded.contains(&upload) && upload.created_at().is_none_or(|at| at < orphaned_before)
            });
            if orphaned {
                self.store().delete(&key).await?;
            }
        }
        Ok(cleared)
    }
}

/// A part being received. Dropped without [`PartWriter::finish`], it leaves nothing.
pub struct PartWriter {
    store: UploadStore,
    record: UploadRecord,
    id: PartId,
    writer: Box<dyn ObjectWriter>,
    /// What the upload's size leaves for this part.
    room: u64,
    /// Its place among the upload's parts.
    slot: PartSlot,
    written: u64,
    created_at: UnixSeconds,
}

impl PartWriter {
    pub async fn write(&mut self, chunk: Bytes) -> Result<(), UploadError> {
        self.written += chunk.len() as u64;
        if self.written > MAX_PART_BYTES {
            return Err(UploadError::PartTooLarge);
        }
        if self.written > self.room {
            return Err(UploadError::OverSize { id: self.record.id.clone(), bytes: self.record.bytes });
        }
        Ok(self.writer.write(chunk).await?)
    }

    pub async fn abort(self) {
        self.writer.abort().await;
    }

    /// Publishes the part: its bytes, then the mark that makes it count.
    pub async fn finish(self) -> Result<PartObject, UploadError> {
        if self.written == 0 {
            self.writer.abort().await;
            return Err(UploadError::EmptyPart);
        }
        let bytes = self.writer.finish().await?;
        let (project, upload) = (&self.record.project_id, &self.record.id);
        let mark = size_key(project, upload, &self.id, bytes);
        if let Err(error) = self.store.store().put(&mark, Bytes::new()).await {
            let _ = self.store.store().delete(&part_key(project, upload, &self.id)).await;
            return Err(error.into());
        }
        self.slot.finish(bytes);
        Ok(PartObject { id: self.id, object: "upload.part", created_at: self.created_at, upload_id: self.record.id })
    }
}
