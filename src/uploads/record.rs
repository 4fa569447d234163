//! The stored Upload and the Upload and Part objects of the API.

use serde::{Deserialize, Serialize};

use crate::clock::UnixSeconds;
use crate::files::{FileObject, Purpose};
use crate::ids::{FileId, PartId, ProjectId, UploadId};

/// What storage says of an upload; `expired` is not stored but seen (see
/// [`UploadRecord::status_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UploadStatus {
    Pending,
    Completed,
    Cancelled,
    Expired,
}

impl UploadStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UploadRecord {
    pub id: UploadId,
    pub project_id: ProjectId,
    pub filename: String,
    pub purpose: Purpose,
    /// The size the parts must add up to.
    pub bytes: u64,
    pub mime_type: String,
    pub created_at: UnixSeconds,
    /// Until when parts are accepted and the upload can be completed.
    pub expires_at: UnixSeconds,
    /// `pending`, `completed` or `cancelled`.
    pub status: UploadStatus,
    /// The file's `expires_after.seconds`, if the create asked for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_expires_after: Option<u64>,
    /// Set on completion: the parts in the order completed, so that the same completion
    /// sent again (a client retrying after a lost answer) gets the same answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub part_ids: Vec<PartId>,
}

impl UploadRecord {
    /// The status as clients see it at `now`: a pending upload past its hour has expired.
    pub fn status_at(&self, now: UnixSeconds) -> UploadStatus {
        match self.status {
            UploadStatus::Pending if now >= self.expires_at => UploadStatus::Expired,
            status => status,
        }
    }

    /// The file a completion makes.
    pub fn file_id(&self) -> FileId {
        self.id.file_id()
    }
}

/// OpenAI's Upload object.
#[derive(Clone, Debug, Serialize)]
pub struct UploadObject {
    pub id: UploadId,
    pub object: &'static str,
    pub bytes: u64,
    pub created_at: UnixSeconds,
    pub expires_at: UnixSeconds,
    pub filename: String,
    pub purpose: &'static str,
    pub status: &'static str,
    /// The File made on completion (`null` before).
    pub file: Option<FileObject>,
}

impl UploadObject {
    pub fn new(record: &UploadRecord, now: UnixSeconds, file: Option<FileObject>) -> Self {
        Self {
            id: record.id.clone(),
            object: "upload",
            bytes: record.bytes,
            created_at: record.created_at,
            expires_at: record.expires_at,
            filename: record.filename.clone(),
            purpose: record.purpose.as_str(),
            status: record.status_at(now).as_str(),
            file,
        }
    }
}

/// OpenAI's Upload Part object.
#[derive(Clone, Debug, Serialize)]
pub struct PartObject {
    pub id: PartId,
    pub object: &'static str,
    pub created_at: UnixSeconds,
    pub upload_id: UploadId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_upload_expires_at_its_hour_and_a_finished_one_never() {
        let mut record = UploadRecord {
            id: UploadId::generate(),
            project_id: ProjectId::generate(),
            filename: "in.jsonl".into(),
            purpose: Purpose::Batch,
            bytes: 10,
            mime_type: "application/jsonl".into(),
            created_at: 1_000,
            expires_at: 4_600,
            status: UploadStatus::Pending,
            file_expires_after: None,
            part_ids: Vec::new(),
        };
        assert_eq!(record.status_at(4_599), UploadStatus::Pending);
        assert_eq!(record.status_at(4_600), UploadStatus::Expired);
        record.status = UploadStatus::Completed;
        assert_eq!(record.status_at(9_999), UploadStatus::Completed);
        record.status = UploadStatus::Cancelled;
        assert_eq!(record.status_at(9_999), UploadStatus::Cancelled);
    }

    #[test]
    fn the_file_of_an_upload_is_always_the_same() {
        let id = UploadId::generate();
        assert_eq!(id.file_id(), id.file_id());
        assert!(id.file_id().as_str().starts_with("file-"));
        assert_eq!(&id.file_id().as_str()[5..], &id.as_str()[7..]);
    }
}
