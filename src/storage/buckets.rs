//! Buckets named by `s3://` locations (an applied Batch's input and output), reached
//! with the configured S3 storage's endpoint, region and credentials. One client a
//! bucket, made on first use.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{S3Settings, S3Store, StorageError};

pub struct Buckets {
    /// The configured storage's settings; `None` when storage is a directory.
    base: Option<S3Settings>,
    open: Mutex<HashMap<String, Arc<S3Store>>>,
}

impl Buckets {
    pub fn new(base: Option<S3Settings>) -> Self {
        Self { base, open: Mutex::default() }
    }

    /// A store of `bucket`'s objects by their whole keys (no installation prefix).
    pub fn bucket(&self, bucket: &str) -> Result<Arc<S3Store>, StorageError> {
        let Some(base) = &self.base else {
            return Err(StorageError::Backend(
                "s3:// locations need S3 storage (storage.s3): this installation stores in a directory".into(),
            ));
        };
        let mut open = self.open.lock().expect("buckets");
        let store = open.entry(bucket.to_owned()).or_insert_with(|| {
            Arc::new(S3Store::new(S3Settings { bucket: bucket.to_owned(), prefix: String::new(), ..base.clone() }))
        });
        Ok(store.clone())
    }
}
