//! Objects in an S3 bucket (AWS, SeaweedFS, Garage, s3s, any S3-compatible server).
//!
//! Small objects are one `PutObject`; larger ones become a multipart upload in
//! [`PART_SIZE`] parts, completed by `finish` and aborted otherwise, so memory per
//! writer stays at one part whatever the object's size.

use std::ops::Range;

use async_trait::async_trait;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{BehaviorVersion, Region, RequestChecksumCalculation, ResponseChecksumValidation};
use aws_sdk_s3::error::{DisplayErrorContext, SdkError};
use aws_sdk_s3::primitives::ByteStream as S3Body;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use super::credentials::{StaticKeys, provider};
use super::{ByteStream, Key, KeyPage, ObjectStore, ObjectWriter, StorageError};

/// S3 wants parts of at least 5 MiB but the last.
const PART_SIZE: usize = 8 * 1024 * 1024;
/// The smallest part S3 accepts but the last, and the largest it copies.
const MIN_PART: u64 = 5 * 1024 * 1024;
const MAX_COPIED_PART: u64 = 5 * 1024 * 1024 * 1024;
/// The most parts one multipart upload may have.
const MAX_PARTS: usize = 10_000;

#[derive(Clone, Debug)]
pub struct S3Settings {
    pub bucket: String,
    /// A custom endpoint (SeaweedFS, s3s, ...); `None` for AWS.
    pub endpoint: Option<String>,
    pub region: String,
    /// Prepended to every key, so one bucket can hold several installations.
    pub prefix: String,
    pub path_style: bool,
    /// `None`: the AWS SDK's default credential chain (see [`super::credentials`]).
    pub keys: Option<StaticKeys>,
    /// How long a request may wait for the server's next bytes (and to connect) before
    /// the attempt fails and the SDK tries again: a stalled server is then an error
    /// like any other, not a request that hangs forever.
    pub timeout: std::time::Duration,
}

pub struct S3Store {
    client: Client,
    bucket: String,
    prefix: String,
}

fn backend<E: std::error::Error + 'static, R: std::fmt::Debug>(error: SdkError<E, R>) -> StorageError {
    StorageError::Backend(DisplayErrorContext(error).to_string())
}

impl S3Store {
    pub fn new(settings: S3Settings) -> Self {
        let credentials = provider(settings.keys, &settings.region);
        let mut config = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(settings.region))
            .credentials_provider(credentials)
            .force_path_style(settings.path_style)
            // Streaming uploads of unknown length cannot carry a precomputed checksum,
            // and several S3-compatible servers reject the trailing-checksum encoding.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(endpoint) = settings.endpoint {
            config = config.endpoint_url(endpoint);
        }
        // Throttling (503 SlowDown), 5xx answers, resets and timeouts are tried again, three
        // attempts with jittered backoff, as AWS advises; built by hand, the config has no retries.
        config = config.retry_config(aws_sdk_s3::config::retry::RetryConfig::standard());
        config = config.timeout_config(
            aws_sdk_s3::config::timeout::TimeoutConfig::builder()
                .connect_timeout(settings.timeout.min(std::time::Duration::from_secs(5)))
                .read_timeout(settings.timeout)
                .build(),
        );
        let prefix = match settings.prefix.trim_matches('/') {
            "" => String::new(),
            trimmed => format!("{trimmed}/"),
        };
        Self { client: Client::from_conf(config.build()), bucket: settings.bucket, prefix }
    }

    fn s3_writer(&self, key: &Key) -> S3Writer {
        S3Writer {
            client: self.client.clone(),
            bucket: self.bucket.clone(),
            prefix: self.prefix.clone(),
            key: self.object_key(key),
            buffer: BytesMut::new(),
            upload: None,
            written: 0,
        }
    }

    fn object_key(&self, key: &Key) -> String {
        format!("{}{}", self.prefix, key)
    }

    /// Aborts the multipart uploads whose markers are older than `age`, and drops the markers.
    pub async fn sweep_uploads(&self, age: std::time::Duration) -> Result<usize, StorageError> {
        let markers = format!("{}{UPLOAD_MARKERS}", self.prefix);
        let mut pages = self.client.list_objects_v2().bucket(&self.bucket).prefix(&markers).into_paginator().send();
        let cutoff = std::time::SystemTime::now() - age;
        let mut aborted = 0;
        while let Some(page) = pages.next().await {
            for object in page.map_err(backend)?.contents() {
                let (Some(marker), Some(modified)) = (object.key(), object.last_modified()) else { continue };
                if std::time::SystemTime::try_from(*modified).is_ok_and(|at| at > cutoff) {
                    continue;
                }
                let body = self.client.get_object().bucket(&self.bucket).key(marker).send().await.map_err(backend)?;
                let bytes = body.body.collect().await.map_err(|e| StorageError::Backend(e.to_string()))?.into_bytes();
                if let Ok(upload) = serde_json::from_slice::<UploadMarker>(&bytes) {
                    let abort = self.client.abort_multipart_upload().bucket(&self.bucket);
                    // Gone already (completed, or aborted by its writer): nothing to do.
                    let _ = abort.key(&upload.key).upload_id(&upload.upload_id).send().await;
                }
                self.client.delete_object().bucket(&self.bucket).key(marker).send().await.map_err(backend)?;
                aborted += 1;
            }
        }
        Ok(aborted)
    }
}

/// Where writers note their multipart uploads until they complete or abort them.
const UPLOAD_MARKERS: &str = "multipart-uploads/";

#[derive(serde::Serialize, serde::Deserialize)]
struct UploadMarker {
    key: String,
    upload_id: String,
}

fn marker_key(prefix: &str, upload_id: &str) -> String {
    format!("{prefix}{UPLOAD_MARKERS}{}", hex::encode(upload_id))
}

#[async_trait]
impl ObjectStore for S3Store {
    async fn writer(&self, key: &Key) -> Result<Box<dyn ObjectWriter>, StorageError> {
        Ok(Box::new(self.s3_writer(key)))
    }

    /// A multipart upload whose parts are copied server-side from the sources, when every
    /// source is a valid part (all but the last at least 5 MiB); streamed otherwise.
    async fn compose(&self, dest: &Key, sources: &[Key]) -> Result<u64, StorageError> {
        let mut sizes = Vec::with_capacity(sources.len());
        for source in sources {
            sizes.push(self.size(source).await?.ok_or_else(|| StorageError::NotFound(source.to_string()))?);
        }
        let copyable = matches!(sizes.split_last(), Some((last, rest))
            if sources.len() <= MAX_PARTS
                && (1..=MAX_COPIED_PART).contains(last)
                && rest.iter().all(|size| (MIN_PART..=MAX_COPIED_PART).contains(size)));
        if !copyable {
            return super::compose_by_streaming(self, dest, sources).await;
        }
        let mut writer = self.s3_writer(dest);
        for (source, size) in sources.iter().zip(sizes) {
            writer.copy_part(&format!("{}/{}", self.bucket, self.object_key(source)), size).await?;
        }
        Box::new(writer).finish().await
    }

    async fn read(&self, key: &Key, range: Option<Range<u64>>) -> Result<ByteStream, StorageError> {
        let mut request = self.client.get_object().bucket(&self.bucket).key(self.object_key(key));
        if let Some(range) = &range {
            if range.start >= range.end {
                // S3 has no way to ask for zero bytes; the object must still exist.
                return match self.size(key).await? {
                    Some(_) => Ok(futures_util::stream::empty().boxed()),
                    None => Err(StorageError::NotFound(key.to_string())),
                };
            }
            request = request.range(format!("bytes={}-{}", range.start, range.end - 1));
        }
        let output = match request.send().await {
            Ok(output) => output,
            Err(error) if error.as_service_error().is_some_and(|e| e.is_no_such_key()) => {
                return Err(StorageError::NotFound(key.to_string()));
            }
            // A range past the end of the object reads as nothing, as on a filesystem.
            Err(error) if error.raw_response().is_some_and(|r| r.status().as_u16() == 416) => {
                return Ok(futures_util::stream::empty().boxed());
            }
            Err(error) => return Err(backend(error)),
        };
        let stream = futures_util::stream::try_unfold(output.body, |mut body| async move {
            match body.try_next().await {
                Ok(Some(chunk)) => Ok(Some((chunk, body))),
                Ok(None) => Ok(None),
                Err(error) => Err(StorageError::Backend(error.to_string())),
            }
        });
        Ok(stream.boxed())
    }

    /// `If-None-Match: *`: S3 refuses the write with 412 when the object exists.
    async fn create_exclusive(&self, key: &Key, bytes: Bytes) -> Result<bool, StorageError> {
        let request = self.client.put_object().bucket(&self.bucket).key(self.object_key(key)).if_none_match("*");
        match request.body(S3Body::from(bytes)).send().await {
            Ok(_) => Ok(true),
            Err(error) if error.raw_response().is_some_and(|r| matches!(r.status().as_u16(), 409 | 412)) => Ok(false),
            Err(error) => Err(backend(error)),
        }
    }

    async fn size(&self, key: &Key) -> Result<Option<u64>, StorageError> {
        let request = self.client.head_object().bucket(&self.bucket).key(self.object_key(key));
        match request.send().await {
            Ok(output) => Ok(Some(output.content_length().unwrap_or(0).max(0) as u64)),
            Err(error) if error.as_service_error().is_some_and(|e| e.is_not_found()) => Ok(None),
            Err(error) => Err(backend(error)),
        }
    }

    async fn delete(&self, key: &Key) -> Result<(), StorageError> {
        let request = self.client.delete_object().bucket(&self.bucket).key(self.object_key(key));
        match request.send().await {
            Ok(_) => Ok(()),
            Err(error) if error.raw_response().is_some_and(|r| r.status().as_u16() == 404) => Ok(()),
            Err(error) => Err(backend(error)),
        }
    }

    /// Multipart uploads are found through the markers their writers leave (S3-compatible
    /// servers do not all list uploads), and aborted once [`super::ABANDONED_UPLOAD`] old.
    async fn sweep_abandoned(&self, _idle: std::time::Duration) -> Result<usize, StorageError> {
        self.sweep_uploads(super::ABANDONED_UPLOAD).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Key>, StorageError> {
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(format!("{}{}", self.prefix, prefix))
            .into_paginator()
            .send();
        let mut keys = Vec::new();
        while let Some(page) = pages.next().await {
            for object in page.map_err(backend)?.contents() {
                let key = object.key().and_then(|k| k.strip_prefix(&self.prefix)).and_then(Key::parse);
                keys.extend(key);
            }
        }
        keys.sort();
        Ok(keys)
    }

    async fn list_page(&self, prefix: &str, start_after: Option<&str>, limit: usize) -> Result<KeyPage, StorageError> {
        // One more than the page, to know whether more follow; S3 answers up to 1,000 a
        // call. The delimiter leaves out the keys of subdirectories.
        let mut keys = Vec::new();
        let mut continuation = None;
        loop {
            let wanted = (limit + 1 - keys.len()).min(1000);
            let page = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(format!("{}{}", self.prefix, prefix))
                .delimiter("/")
                .set_start_after(
                    start_after.filter(|_| continuation.is_none()).map(|after| format!("{}{after}", self.prefix)),
                )
                .set_continuation_token(continuation.take())
                .max_keys(wanted as i32)
                .send()
                .await
                .map_err(backend)?;
            let found = page.contents().iter().filter_map(|object| object.key());
            keys.extend(found.filter_map(|key| key.strip_prefix(&self.prefix)).filter_map(Key::parse));
            continuation = page.next_continuation_token().map(str::to_owned);
            if keys.len() > limit || continuation.is_none() {
                break;
            }
        }
        let more = keys.len() > limit;
        keys.truncate(limit);
        Ok(KeyPage { keys, more })
    }
}

struct MultipartUpload {
    id: String,
    parts: Vec<CompletedPart>,
}

struct S3Writer {
    client: Client,
    bucket: String,
    /// The store's prefix, for the upload's marker.
    prefix: String,
    key: String,
    buffer: BytesMut,
    upload: Option<MultipartUpload>,
    written: u64,
}

impl S3Writer {
    /// Starts the multipart upload, once.
    async fn start_upload(&mut self) -> Result<&mut MultipartUpload, StorageError> {
        if self.upload.is_none() {
            let created = self
                .client
                .create_multipart_upload()
                .bucket(&self.bucket)
                .key(&self.key)
                .send()
                .await
                .map_err(backend)?;
            let id = created.upload_id().unwrap_or_default().to_owned();
            // Noted before any part, so that a crash from here on leaves a marker to sweep.
            let marker = UploadMarker { key: self.key.clone(), upload_id: id.clone() };
            let marker = serde_json::to_vec(&marker).expect("markers serialize");
            let request = self.client.put_object().bucket(&self.bucket).key(marker_key(&self.prefix, &id));
            self.upload = Some(MultipartUpload { id, parts: Vec::new() });
            request.body(S3Body::from(marker)).send().await.map_err(backend)?;
        }
        Ok(self.upload.as_mut().expect("multipart upload started above"))
    }

    async fn upload_part(&mut self) -> Result<(), StorageError> {
        let body = self.buffer.split().freeze();
        let (client, bucket, key) = (self.client.clone(), self.bucket.clone(), self.key.clone());
        let upload = self.start_upload().await?;
        let part_number = upload.parts.len() as i32 + 1;
        let uploaded = client
            .upload_part()
            .bucket(bucket)
            .key(key)
            .upload_id(&upload.id)
            .part_number(part_number)
            .body(S3Body::from(body))
            .send()
            .await
            .map_err(backend)?;
        upload.parts.push(
            CompletedPart::builder().part_number(part_number).set_e_tag(uploaded.e_tag().map(str::to_owned)).build(),
        );
        Ok(())
    }

    /// Copies `source` (`bucket/key`, `size` bytes) server-side as the next part.
    async fn copy_part(&mut self, source: &str, size: u64) -> Result<(), StorageError> {
        let (client, bucket, key) = (self.client.clone(), self.bucket.clone(), self.key.clone());
        let upload = self.start_upload().await?;
        let part_number = upload.parts.len() as i32 + 1;
        let copied = client
            .upload_part_copy()
            .bucket(bucket)
            .key(key)
            .upload_id(&upload.id)
            .part_number(part_number)
            .copy_source(source)
            .send()
            .await
            .map_err(backend)?;
        let e_tag = copied.copy_part_result().and_then(|result| result.e_tag()).map(str::to_owned);
        upload.parts.push(CompletedPart::builder().part_number(part_number).set_e_tag(e_tag).build());
        self.written += size;
        Ok(())
    }

    async fn complete(&mut self) -> Result<(), StorageError> {
        if self.upload.is_none() {
            let body = self.buffer.split().freeze();
            let request = self.client.put_object().bucket(&self.bucket).key(&self.key);
            request.body(S3Body::from(body)).send().await.map_err(backend)?;
            return Ok(());
        }
        if !self.buffer.is_empty() {
            self.upload_part().await?;
        }
        let upload = self.upload.as_ref().expect("multipart upload in progress");
        self.client
            .complete_multipart_upload()
            .bucket(&self.bucket)
            .key(&self.key)
            .upload_id(&upload.id)
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(upload.parts.clone())).build())
            .send()
            .await
            .map_err(backend)?;
        let marker = marker_key(&self.prefix, &upload.id);
        self.upload = None;
        if let Err(error) = self.client.delete_object().bucket(&self.bucket).key(marker).send().await {
            tracing::warn!(error = %DisplayErrorContext(error), "could not drop a finished upload's marker");
        }
        Ok(())
    }

    fn abort_request(&mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let upload = self.upload.take()?;
        let marker = self.client.delete_object().bucket(&self.bucket).key(marker_key(&self.prefix, &upload.id));
        let request = self.client.abort_multipart_upload().bucket(&self.bucket).key(&self.key).upload_id(upload.id);
        Some(async move {
            match request.send().await {
                // Aborted: the marker has served (a sweep would find nothing to abort).
                Ok(_) => drop(marker.send().await),
                Err(error) => tracing::warn!(error = %DisplayErrorContext(error), "could not abort a multipart upload"),
            }
        })
    }
}

#[async_trait]
impl ObjectWriter for S3Writer {
    async fn write(&mut self, chunk: Bytes) -> Result<(), StorageError> {
        self.written += chunk.len() as u64;
        self.buffer.extend_from_slice(&chunk);
        if self.buffer.len() >= PART_SIZE {
            self.upload_part().await?;
        }
        Ok(())
    }

    async fn finish(mut self: Box<Self>) -> Result<u64, StorageError> {
        if let Err(error) = self.complete().await {
            if let Some(abort) = self.abort_request() {
                abort.await;
            }
            return Err(error);
        }
        Ok(self.written)
    }

    async fn abort(mut self: Box<Self>) {
        if let Some(abort) = self.abort_request() {
            abort.await;
        }
    }
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        if let (Some(abort), Ok(runtime)) = (self.abort_request(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(abort);
        }
    }
}
