//! A Batch a user declares with `kubectl apply`: where its input is, where its output
//! goes, and the request fields the API takes. Pure: the request's shape, the checks
//! that need no file, and which project it belongs to. The controller accepts it
//! (`super::accept`): reads the input, validates it, and records the batch on the same
//! resource.

use std::collections::BTreeSet;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::batches::create::{CreateBatch, CreateError};
use crate::ids::ProjectId;
use crate::storage::uri::{S3Uri, UriError};

/// Where an applied Batch's input is: an object in a bucket, or a file uploaded with the
/// Files API (one of the two).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InputSource {
    /// `s3://bucket/key`: read once, at acceptance, into a `batch` file of the project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// A file of the project, uploaded with purpose `batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_id: Option<String>,
}

/// Where an applied Batch's output and error files are copied once it finishes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OutputTarget {
    /// `s3://bucket/prefix/`: the files land at `<prefix><batch id>/output.jsonl` and
    /// `<prefix><batch id>/errors.jsonl`.
    pub uri: String,
    /// Whether the files stay in the Files API too (default); `false`: only in the bucket.
    #[serde(default = "keep", skip_serializing_if = "is_true")]
    pub keep_files: bool,
}

fn keep() -> bool {
    true
}

fn is_true(value: &bool) -> bool {
    *value
}

/// What a user applies: the fields of `POST /v1/batches`, with the input and the output
/// named by where they are.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchRequest {
    pub input: InputSource,
    pub output: Option<OutputTarget>,
    pub endpoint: String,
    pub completion_window: Option<String>,
    pub metadata: Map<String, Value>,
    /// The `priority` set on the batch's lines, over its upstream's.
    pub priority: Option<i64>,
}

/// Where an applied input comes from, once checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Object(S3Uri),
    File(String),
}

/// The request as the API would take it (the same checks, the same messages), with where
/// its input is and where its output goes.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub input: Input,
    pub output: Option<(S3Uri, bool)>,
    pub create: CreateBatch,
}

impl BatchRequest {
    /// The checks that need no file: the API's request checks (a JSON body made of the
    /// fields), then the input and output locations.
    pub fn check(&self) -> Result<Checked, CreateError> {
        let refused =
            |param: &'static str| move |error: UriError| CreateError::Request { message: error.to_string(), param };
        let (input, named) = match (&self.input.uri, &self.input.file_id) {
            (Some(uri), None) => (Input::Object(S3Uri::object(uri).map_err(refused("input.uri"))?), uri),
            (None, Some(file)) => (Input::File(file.clone()), file),
            _ => {
                return Err(CreateError::Request {
                    message: "input names exactly one of uri and file_id".into(),
                    param: "input",
                });
            }
        };
        let mut body = Map::new();
        body.insert("input_file_id".into(), Value::String(named.clone()));
        body.insert("endpoint".into(), Value::String(self.endpoint.clone()));
        if let Some(window) = &self.completion_window {
            body.insert("completion_window".into(), Value::String(window.clone()));
        }
        body.insert("metadata".into(), Value::Object(self.metadata.clone()));
        // For an object, `input_file_id` holds its URI until it is read into a file.
        let create = CreateBatch::parse(&Value::Object(body))?;
        let output = match &self.output {
            Some(output) => Some((S3Uri::prefix(&output.uri).map_err(refused("output.uri"))?, output.keep_files)),
            None => None,
        };
        Ok(Checked { input, output, create })
    }
}

/// Which project an applied Batch belongs to: the one its project label names, else the
/// namespace's only Project. `projects`: the Project resources' ids.
pub fn project_of(label: Option<&str>, projects: &BTreeSet<ProjectId>) -> Result<ProjectId, String> {
    match label {
        Some(id) => ProjectId::parse(id)
            .filter(|id| projects.contains(id))
            .ok_or_else(|| format!("the project label names {id:?}, which no Project resource in the namespace has")),
        None => match projects.iter().collect::<Vec<_>>().as_slice() {
            [only] => Ok((*only).clone()),
            [] => Err("no Project resource in the namespace: create one, or label the Batch with its project".into()),
            _ => Err(format!(
                "{} Project resources in the namespace: label the Batch with nightshift.dev/project to say whose it is",
                projects.len()
            )),
        },
    }
}

/// Where a finished batch's files land under the output prefix.
pub fn output_uris(prefix: &S3Uri, batch: &str) -> (S3Uri, S3Uri) {
    let folder = prefix.join(batch);
    (folder.join("output.jsonl"), folder.join("errors.jsonl"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(input: InputSource) -> BatchRequest {
        BatchRequest {
            input,
            output: Some(OutputTarget { uri: "s3://results/nightly/".into(), keep_files: true }),
            endpoint: "/v1/chat/completions".into(),
            completion_window: None,
            metadata: Map::new(),
            priority: None,
        }
    }

    fn message(result: Result<Checked, CreateError>) -> (String, &'static str) {
        match result {
            Err(CreateError::Request { message, param }) => (message, param),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn an_applied_request_is_checked_as_the_api_checks_one_and_its_locations_parsed() {
        let by_uri = request(InputSource { uri: Some("s3://data/evals/in.jsonl".into()), file_id: None });
        let checked = by_uri.check().unwrap();
        assert_eq!(checked.input, Input::Object(S3Uri::object("s3://data/evals/in.jsonl").unwrap()));
        assert_eq!(checked.output, Some((S3Uri::prefix("s3://results/nightly/").unwrap(), true)));
        assert_eq!(checked.create.endpoint, "/v1/chat/completions");

        let by_file = request(InputSource { uri: None, file_id: Some("file-abc".into()) });
        assert_eq!(by_file.check().unwrap().input, Input::File("file-abc".into()));

        let both = request(InputSource { uri: Some("s3://data/in.jsonl".into()), file_id: Some("file-abc".into()) });
        assert_eq!(message(both.check()), ("input names exactly one of uri and file_id".into(), "input"));
        let neither = request(InputSource { uri: None, file_id: None });
        assert_eq!(message(neither.check()).1, "input");

        let prefix = request(InputSource { uri: Some("s3://data/evals/".into()), file_id: None });
        assert_eq!(message(prefix.check()).1, "input.uri");
        let mut bad_output = by_uri.clone();
        bad_output.output = Some(OutputTarget { uri: "gs://results/".into(), keep_files: true });
        assert_eq!(message(bad_output.check()).1, "output.uri");

        let mut window = by_uri.clone();
        window.completion_window = Some("48h".into());
        assert_eq!(message(window.check()), ("completion_window must be \"24h\"".into(), "completion_window"));
        let mut big = by_uri.clone();
        big.metadata = Map::from_iter([("notes".to_owned(), json!("x".repeat(17 * 1024)))]);
        assert_eq!(message(big.check()).1, "metadata");
        let mut no_endpoint = by_uri;
        no_endpoint.endpoint = String::new();
        assert_eq!(message(no_endpoint.check()), ("endpoint is required".into(), "endpoint"));
    }

    #[test]
    fn the_project_is_the_labelled_one_or_the_namespaces_only_one() {
        let a = ProjectId::generate();
        let b = ProjectId::generate();
        let one = BTreeSet::from([a.clone()]);
        let two = BTreeSet::from([a.clone(), b.clone()]);
        assert_eq!(project_of(None, &one), Ok(a.clone()));
        assert_eq!(project_of(Some(b.as_str()), &two), Ok(b.clone()));
        assert!(project_of(None, &two).unwrap_err().contains("label the Batch"));
        assert!(project_of(None, &BTreeSet::new()).unwrap_err().contains("no Project resource"));
        assert!(project_of(Some(b.as_str()), &one).unwrap_err().contains("no Project resource in the namespace has"));
        assert!(project_of(Some("not an id"), &one).is_err());
    }

    #[test]
    fn outputs_land_in_a_folder_named_after_the_batch() {
        let prefix = S3Uri::prefix("s3://results/nightly/").unwrap();
        let (output, errors) = output_uris(&prefix, "batch_01ABC");
        assert_eq!(output.to_string(), "s3://results/nightly/batch_01ABC/output.jsonl");
        assert_eq!(errors.to_string(), "s3://results/nightly/batch_01ABC/errors.jsonl");
    }
}
