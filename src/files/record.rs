//! The stored file record and the File object it is shown as.

use serde::{Deserialize, Serialize};

use crate::clock::UnixSeconds;
use crate::ids::{FileId, ProjectId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// Uploaded batch input.
    Batch,
    /// Output and error files that batches write.
    BatchOutput,
}

impl Purpose {
    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "batch" => Some(Self::Batch),
            "batch_output" => Some(Self::BatchOutput),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::BatchOutput => "batch_output",
        }
    }
}

/// What storage keeps about a file, next to its bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    pub id: FileId,
    pub project_id: ProjectId,
    pub bytes: u64,
    pub created_at: UnixSeconds,
    pub filename: String,
    pub purpose: Purpose,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<UnixSeconds>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
    /// Set by `DELETE`: the file is gone for the API at once, and for storage at the
    /// next garbage collection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted_at: Option<UnixSeconds>,
}

impl FileRecord {
    /// Whether the API still shows this file at `now`.
    pub fn is_live(&self, now: UnixSeconds) -> bool {
        self.deleted_at.is_none() && self.expires_at.is_none_or(|at| at > now)
    }
}

/// OpenAI's File object.
#[derive(Clone, Debug, Serialize)]
pub struct FileObject {
    pub id: FileId,
    pub object: &'static str,
    pub bytes: u64,
    pub created_at: UnixSeconds,
    pub filename: String,
    pub purpose: &'static str,
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<UnixSeconds>,
    /// Present (and true) only on a batch's error file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
}

impl From<&FileRecord> for FileObject {
    fn from(record: &FileRecord) -> Self {
        Self {
            id: record.id.clone(),
            object: "file",
            bytes: record.bytes,
            created_at: record.created_at,
            filename: record.filename.clone(),
            purpose: record.purpose.as_str(),
            status: "processed",
            expires_at: record.expires_at,
            is_error: record.is_error.then_some(true),
        }
    }
}
