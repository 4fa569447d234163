//! A Batch's `spec` on the wire: one flat object, so that a user applies the fields the
//! API takes (`input`, `endpoint`, `completion_window`, `metadata`, `output`,
//! `ttlSecondsAfterFinished`) and the batch, once accepted, adds its record beside them
//! (`id`, `project_id`, `input_file_id`, `created_at`, `plan`, ...). The two share
//! `endpoint`, `completion_window` and `metadata`, with the same values. Its schema
//! carries the validation rules the API server enforces at apply time.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::{BatchResourceSpec, WebhookRef};
use crate::k8s::applied::{BatchRequest, InputSource, OutputTarget};
use crate::validate::BATCHABLE_URLS;

/// The fields only a user's request has.
#[derive(Serialize, Deserialize, JsonSchema)]
struct Declared {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    input: Option<InputSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    output: Option<OutputTarget>,
    #[serde(rename = "ttlSecondsAfterFinished", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    ttl_seconds_after_finished: Option<i64>,
    /// Where this batch's events go, besides its project's endpoints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    webhooks: Vec<WebhookRef>,
}

/// The request fields a user's Batch shares with the record (`priority` is set by a user
/// only, and kept in the record for the workers).
#[derive(Deserialize)]
struct Shared {
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    completion_window: Option<String>,
    #[serde(default)]
    metadata: Map<String, Value>,
    #[serde(default)]
    priority: Option<i64>,
}

impl Serialize for BatchResourceSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut object = Map::new();
        if let Some(request) = &self.request {
            object.insert("endpoint".into(), Value::String(request.endpoint.clone()));
            if let Some(window) = &request.completion_window {
                object.insert("completion_window".into(), Value::String(window.clone()));
            }
            if !request.metadata.is_empty() {
                object.insert("metadata".into(), Value::Object(request.metadata.clone()));
            }
            if let Some(priority) = request.priority {
                object.insert("priority".into(), Value::from(priority));
            }
        }
        if let Some(batch) = &self.batch {
            let Value::Object(record) = serde_json::to_value(batch).map_err(serde::ser::Error::custom)? else {
                unreachable!("a BatchSpec serializes to an object");
            };
            object.extend(record);
        }
        let declared = Declared {
            input: self.request.as_ref().map(|r| r.input.clone()),
            output: self.request.as_ref().and_then(|r| r.output.clone()),
            ttl_seconds_after_finished: self.ttl_seconds_after_finished,
            webhooks: self.webhooks.clone(),
        };
        let Value::Object(declared) = serde_json::to_value(declared).map_err(serde::ser::Error::custom)? else {
            unreachable!("a struct serializes to an object");
        };
        object.extend(declared);
        object.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for BatchResourceSpec {
    /// A spec with `input` is a user's request; one with `id` is accepted (a record that
    /// does not decode is an error, never read as "not accepted yet").
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        let declared = Declared::deserialize(&value).map_err(D::Error::custom)?;
        let request = match declared.input {
            Some(input) => {
                let shared = Shared::deserialize(&value).map_err(D::Error::custom)?;
                Some(BatchRequest {
                    input,
                    output: declared.output,
                    endpoint: shared.endpoint,
                    completion_window: shared.completion_window,
                    metadata: shared.metadata,
                    priority: shared.priority,
                })
            }
            None => None,
        };
        let batch = match value.get("id") {
            Some(_) => Some(Deserialize::deserialize(&value).map_err(D::Error::custom)?),
            None => None,
        };
        Ok(Self {
            request,
            ttl_seconds_after_finished: declared.ttl_seconds_after_finished,
            webhooks: declared.webhooks,
            batch,
        })
    }
}

/// A validation rule of the CRD's schema (`x-kubernetes-validations`).
fn rule(rule: &str, message: &str) -> Value {
    serde_json::json!({"rule": rule, "message": message})
}

/// The fields that never change once written (by the user, or by whoever accepted the
/// batch). A transition rule on a field holds only where the old object had it too.
const IMMUTABLE: [&str; 14] = [
    "input",
    "output",
    "endpoint",
    "completion_window",
    "metadata",
    "id",
    "project_id",
    "input_file_id",
    "created_at",
    "expires_at",
    "model",
    "output_expires_after",
    "priority",
    "plan",
];

/// What the API server checks when a Batch is applied, with no file read: the fields the
/// controller checks again (older API servers skip these rules).
fn spec_rules() -> Vec<Value> {
    let endpoints = BATCHABLE_URLS.iter().map(|url| format!("'{url}'")).collect::<Vec<_>>().join(", ");
    let mut rules = vec![
        rule(
            "has(self.input) || has(self.id)",
            "spec.input is required: {uri: s3://bucket/key} or {file_id: file-...}",
        ),
        rule("has(self.endpoint) && self.endpoint != ''", "spec.endpoint is required"),
        rule(
            &format!("!has(self.endpoint) || self.endpoint in [{endpoints}]"),
            &format!("spec.endpoint must be one of {}", BATCHABLE_URLS.join(", ")),
        ),
        rule("!has(self.completion_window) || self.completion_window == '24h'", "completion_window must be \"24h\""),
        rule(
            "has(self.input) == has(oldSelf.input)",
            "spec.input cannot be added to or removed from a Batch: create a new Batch",
        ),
    ];
    rules.extend(IMMUTABLE.iter().filter(|field| **field != "input").map(|field| {
        rule(
            &format!("!has(oldSelf.{field}) || has(self.{field})"),
            &format!("spec.{field} cannot be removed from a Batch"),
        )
    }));
    rules
}

const OBJECT_URI: &str =
    r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/([A-Za-z0-9=_-][A-Za-z0-9=_.-]*/)*[A-Za-z0-9=_-][A-Za-z0-9=_.-]*$";
const PREFIX_URI: &str = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/([A-Za-z0-9=_-][A-Za-z0-9=_.-]*/?)*)?$";

impl JsonSchema for BatchResourceSpec {
    fn schema_name() -> Cow<'static, str> {
        "BatchResourceSpec".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let mut record = <crate::batches::BatchSpec as JsonSchema>::json_schema(generator);
        let declared = <Declared as JsonSchema>::json_schema(generator);
        let record = record.as_object_mut().expect("an object schema");
        // Every field is optional on the wire: a user's Batch has no record yet, and one
        // made through the API has no `input`. The rules say what must be there.
        record.remove("required");
        let properties = record.get_mut("properties").and_then(Value::as_object_mut).expect("properties");
        properties.extend(declared.get("properties").and_then(Value::as_object).cloned().unwrap_or_default());
        for field in IMMUTABLE.iter().filter(|field| **field != "input") {
            let message = format!("spec.{field} is immutable: create a new Batch to change it");
            let property = properties.get_mut(*field).and_then(Value::as_object_mut).expect("an immutable field");
            property.insert("x-kubernetes-validations".into(), Value::Array(vec![rule("self == oldSelf", &message)]));
        }
        let input = properties["input"].as_object_mut().expect("input");
        input.insert(
            "x-kubernetes-validations".into(),
            Value::Array(vec![
                rule("self == oldSelf", "spec.input is immutable: create a new Batch to change it"),
                rule("has(self.uri) != has(self.file_id)", "spec.input names exactly one of uri and file_id"),
            ]),
        );
        let uri_rule = |description: &Value, pattern: &str, message: &str| {
            json_schema!({
                "description": description,
                "type": "string",
                "x-kubernetes-validations": [rule(&format!("self.matches('{pattern}')"), message)],
            })
        };
        let object = "spec.input.uri must be s3://bucket/key: a bucket name, and a key of letters, digits, '-', '_', \
                      '.' and '=' segments";
        input["properties"]["uri"] = uri_rule(&input["properties"]["uri"]["description"], OBJECT_URI, object).into();
        let output = properties["output"].as_object_mut().expect("output");
        let prefix = "spec.output.uri must be s3://bucket/ or s3://bucket/prefix/ (letters, digits, '-', '_', '.' and \
                      '=' segments)";
        output["properties"]["uri"] = uri_rule(&output["properties"]["uri"]["description"], PREFIX_URI, prefix).into();
        record.insert("x-kubernetes-validations".into(), Value::Array(spec_rules()));
        record.insert(
            "description".into(),
            "A batch: what a user applied (`input`, `output`, the request's fields), and once it is accepted, \
             its record (`id`, `project_id`, `input_file_id`, `created_at`, `expires_at`, `plan`), immutable."
                .into(),
        );
        Schema::from(record.clone())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::batches::BatchSpec;
    use crate::validate::ShardPlan;

    fn applied() -> Value {
        json!({
            "input": {"uri": "s3://data/evals/in.jsonl"},
            "endpoint": "/v1/chat/completions",
            "metadata": {"team": "evals", "nested": {"a": [1, 2]}},
            "output": {"uri": "s3://results/nightly/"},
            "ttlSecondsAfterFinished": 3600,
        })
    }

    #[test]
    fn an_applied_spec_reads_as_a_request_and_keeps_its_fields_when_accepted() {
        let spec: BatchResourceSpec = serde_json::from_value(applied()).unwrap();
        let request = spec.request.clone().unwrap();
        assert_eq!(request.input.uri.as_deref(), Some("s3://data/evals/in.jsonl"));
        assert_eq!(
            request.output.as_ref().map(|o| (o.uri.as_str(), o.keep_files)),
            Some(("s3://results/nightly/", true))
        );
        assert_eq!(request.metadata["nested"], json!({"a": [1, 2]}));
        assert_eq!(spec.ttl_seconds_after_finished, Some(3600));
        assert!(spec.batch.is_none(), "not accepted yet");
        assert_eq!(serde_json::to_value(&spec).unwrap(), applied(), "written back as applied");

        let mut record = BatchSpec::sample(ShardPlan::default(), 10, 86_410);
        record.metadata = request.metadata.clone();
        let accepted = BatchResourceSpec { batch: Some(record.clone()), ..spec };
        let wire = serde_json::to_value(&accepted).unwrap();
        assert_eq!(wire["id"], json!(record.id), "the record beside the request");
        assert_eq!(wire["input"], applied()["input"]);
        let read: BatchResourceSpec = serde_json::from_value(wire).unwrap();
        assert_eq!(read.batch, accepted.batch);
        let window = read.request.as_ref().and_then(|r| r.completion_window.as_deref());
        assert_eq!(window, Some("24h"), "the shared fields are the record's now");
    }

    #[test]
    fn a_batch_made_through_the_api_has_no_request_and_a_broken_record_does_not_decode() {
        let record = BatchSpec::sample(ShardPlan::default(), 10, 86_410);
        let spec = BatchResourceSpec::recorded(record.clone());
        let wire = serde_json::to_value(&spec).unwrap();
        assert!(wire.get("input").is_none() && wire.get("ttlSecondsAfterFinished").is_none(), "{wire}");
        assert_eq!(serde_json::from_value::<BatchResourceSpec>(wire.clone()).unwrap(), spec);

        let mut broken = wire;
        broken["created_at"] = json!("yesterday");
        assert!(serde_json::from_value::<BatchResourceSpec>(broken).is_err(), "never read as not accepted");
    }
}
