//! OpenAI's Uploads API: a file sent in parts (each up to 64 MB), assembled into one File
//! on completion, so that a batch input can reach the 200 MB input limit although a single
//! `POST /v1/files` stops at 100 MB.
//!
//! [`request`] parses and checks what clients send (pure); [`record`] is the stored Upload
//! and the objects it is shown as; [`store`] keeps uploads and parts in object storage and
//! assembles the file; [`tally`] counts what each pending upload holds.

pub mod record;
pub mod request;
pub mod store;
mod tally;

pub use record::{PartObject, UploadObject, UploadRecord, UploadStatus};
pub use request::{CompleteUpload, NewUpload, RequestError};
pub use store::{UploadError, UploadStore};

/// The largest part (OpenAI's 64 MB).
pub const MAX_PART_BYTES: u64 = 64 * 1024 * 1024;
/// The most parts one upload may have (as many as an S3 multipart upload).
pub const MAX_PARTS: usize = 10_000;
/// How long an upload accepts parts and completion (OpenAI's hour).
pub const UPLOAD_LIFETIME_SECONDS: i64 = 3_600;
