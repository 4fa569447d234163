//! Schema pieces of the Batch document that a Kubernetes structural schema needs (the
//! document is a Batch resource's status there) and schemars does not know.

use schemars::{Schema, SchemaGenerator, json_schema};

/// Any JSON object, kept as it is: Kubernetes prunes fields a schema does not name,
/// unless told to preserve them.
pub fn any_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// An optional string enum: Kubernetes wants `nullable`, not `null` among the values.
pub fn optional_ending(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "enum": ["completed", "cancelled", "expired"],
        "nullable": true,
    })
}

/// A map from shard index to a count: object keys are strings in JSON, and Kubernetes
/// refuses the `patternProperties` schemars gives integer keys.
pub fn counts_by_shard(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "additionalProperties": {"type": "integer", "format": "int64", "minimum": 0},
    })
}
