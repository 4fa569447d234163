//! The chart's `values.yaml` as documentation: its `# --` comments become the chart's
//! README table and its defaults (with a comment's leading `(type)`, when a default
//! can't say the type) become `values.schema.json`, which Helm checks values against.
//!
//! The comments are read line by line (values.yaml is written to this shape: a key's
//! comment is the block of `#` lines just above it); the defaults come from the YAML.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

/// A key's comment: its description and the type it names, if any.
#[derive(Clone, Debug, Default)]
struct Doc {
    /// Written with `# --`: a value users set (a README row).
    documented: bool,
    /// `(object)`, `(int)`, ... at the start of the comment.
    kind: Option<String>,
    text: String,
}

/// Comments by dotted key path.
fn docs(values_yaml: &str) -> HashMap<String, Doc> {
    let mut docs = HashMap::new();
    let mut comment: Vec<&str> = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    for line in values_yaml.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(text) = trimmed.strip_prefix('#') {
            comment.push(text);
            continue;
        }
        let key = trimmed.split_once(':').map(|(key, _)| key).filter(|key| !key.is_empty() && !key.contains(' '));
        let Some(key) = key.filter(|_| !trimmed.starts_with('-')) else {
            comment.clear();
            continue;
        };
        path.retain(|(depth, _)| *depth < indent);
        path.push((indent, key.trim_matches('"').to_owned()));
        let dotted = path.iter().map(|(_, key)| key.as_str()).collect::<Vec<_>>().join(".");
        docs.insert(dotted, parse_comment(&comment));
        comment.clear();
    }
    docs
}

fn parse_comment(lines: &[&str]) -> Doc {
    let documented = lines.first().is_some_and(|first| first.trim_start().starts_with("--"));
    // Indented lines are examples: values.yaml shows them, the table doesn't.
    let prose: Vec<&str> = lines
        .iter()
        .filter(|line| !line.starts_with("   "))
        .map(|line| line.trim())
        .map(|line| line.strip_prefix("--").unwrap_or(line).trim())
        .collect();
    let mut text = prose.join(" ");
    if let Some(rest) = text.strip_suffix(" Example:") {
        text = rest.to_owned();
    }
    let mut kind = None;
    if let Some(rest) = text.strip_prefix('(')
        && let Some((named, rest)) = rest.split_once(") ")
        && !named.contains(' ')
    {
        kind = Some(named.to_owned());
        text = rest.to_owned();
    }
    Doc { documented, kind, text }
}

/// The chart README's values table: every `# --` key, sorted (as helm-docs sorts).
pub fn readme_table(values_yaml: &str) -> String {
    let docs = docs(values_yaml);
    let values: Value = serde_yaml_ng::from_str(values_yaml).unwrap();
    let mut rows = String::from("| Key | Type | Default | Description |\n|---|---|---|---|\n");
    walk(&values, "", &mut |path, value| {
        let doc = docs.get(path).cloned().unwrap_or_default();
        if doc.documented {
            let default = serde_json::to_string(value).unwrap().replace('|', "\\|");
            let kind = doc.kind.clone().unwrap_or_else(|| type_name(value).to_owned());
            rows.push_str(&format!("| `{path}` | {kind} | `{default}` | {} |\n", doc.text.replace('|', "\\|")));
        }
    });
    rows
}

/// Calls `visit` with every key's path and default, parents before children.
fn walk(value: &Value, prefix: &str, visit: &mut dyn FnMut(&str, &Value)) {
    if let Value::Object(map) = value {
        for (key, child) in map {
            let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            visit(&path, child);
            walk(child, &path, visit);
        }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "string",
        Value::Array(_) => "list",
        Value::Object(_) => "object",
    }
}

fn json_type(kind: &str) -> &'static str {
    match kind {
        "bool" => "boolean",
        "int" => "integer",
        "float" => "number",
        "string" => "string",
        "list" => "array",
        "object" => "object",
        other => panic!("values.yaml names an unknown type ({other})"),
    }
}

/// `values.schema.json`: the defaults' types. Objects with documented keys are closed
/// (a misspelled key is an error), unless their comment says `(object)`: free-form maps
/// such as annotations or a securityContext, whose listed keys are only defaults (and
/// everything under them is open too).
pub fn schema(values_yaml: &str) -> Value {
    let docs = docs(values_yaml);
    let values: Value = serde_yaml_ng::from_str(values_yaml).unwrap();
    let mut schema = schema_of(&values, "", &docs, false);
    let root = schema.as_object_mut().unwrap();
    root.insert("$schema".into(), json!("https://json-schema.org/draft-07/schema#"));
    root.insert("title".into(), json!("Values of the Nightshift chart (generated from values.yaml)"));
    schema
}

/// `open`: under a free-form object, where nothing is closed.
fn schema_of(value: &Value, path: &str, docs: &HashMap<String, Doc>, open: bool) -> Value {
    let doc = docs.get(path).cloned().unwrap_or_default();
    let mut schema = Map::new();
    if !doc.text.is_empty() {
        schema.insert("description".into(), json!(doc.text));
    }
    let named = doc.kind.as_deref().map(json_type);
    match (value, named) {
        (Value::Null, Some(kind)) => {
            schema.insert("type".into(), json!([kind, "null"]));
        }
        (Value::Null, None) => {}
        (Value::Object(map), _) if !map.is_empty() => {
            schema.insert("type".into(), json!("object"));
            let open = open || named == Some("object");
            let properties: Map<String, Value> = map
                .iter()
                .map(|(key, child)| {
                    let child_path = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                    (key.clone(), schema_of(child, &child_path, docs, open))
                })
                .collect();
            schema.insert("properties".into(), Value::Object(properties));
            if !open {
                schema.insert("additionalProperties".into(), json!(false));
            }
        }
        (value, named) => {
            schema.insert("type".into(), json!(named.unwrap_or_else(|| json_type(type_name(value)))));
        }
    }
    Value::Object(schema)
}

/// Every `.Values.a.b` the templates read, as `a.b`.
pub fn template_references(templates: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = templates;
    while let Some(at) = rest.find(".Values.") {
        rest = &rest[at + ".Values.".len()..];
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_')).unwrap_or(rest.len());
        found.push(rest[..end].trim_end_matches('.').to_owned());
    }
    found.sort();
    found.dedup();
    found
}
