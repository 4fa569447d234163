//! An object that fails to decode must not stall a watch. A Batch made under an older CRD
//! schema, or edited past ours by hand, would otherwise fail every list of the watch that
//! meets it, and with it every cache of the controller and the api. Watches decode into
//! kube's [`DeserializeGuard`]; invalid objects are reported and left out of the caches.

use futures_util::{Stream, TryStreamExt, future};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::watcher::{self, Event};

/// `stream` with the objects that failed to decode taken out and handed to `report`.
pub fn valid_only<K, S>(
    stream: S,
    mut report: impl FnMut(InvalidObject) + Send + 'static,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    S: Stream<Item = Result<Event<DeserializeGuard<K>>, watcher::Error>> + Send,
    K: Send,
{
    stream.try_filter_map(move |event| future::ready(Ok(split(event, &mut report))))
}

/// The event without its invalid object (`None` when nothing is left of it).
fn split<K>(event: Event<DeserializeGuard<K>>, report: &mut impl FnMut(InvalidObject)) -> Option<Event<K>> {
    let mut valid = |guard: DeserializeGuard<K>| guard.0.map_err(&mut *report).ok();
    match event {
        Event::Apply(guard) => valid(guard).map(Event::Apply),
        Event::InitApply(guard) => valid(guard).map(Event::InitApply),
        // Nothing to report of an object that is gone.
        Event::Delete(guard) => guard.0.ok().map(Event::Delete),
        Event::Init => Some(Event::Init),
        Event::InitDone => Some(Event::InitDone),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::k8s::crd::BatchResource;

    fn guard(spec: serde_json::Value) -> DeserializeGuard<BatchResource> {
        serde_json::from_value(json!({
            "apiVersion": "nightshift.dev/v1alpha1", "kind": "Batch",
            "metadata": {"name": "batch-x", "namespace": "ns", "uid": "u1"},
            "spec": spec,
        }))
        .expect("a guard decodes whatever the object holds")
    }

    #[test]
    fn a_batch_with_shard_failures_decodes_through_the_guard() {
        // The guard decodes through a generic value, where map keys stay strings.
        let mut resource = BatchResource::new(
            "batch-x",
            crate::k8s::crd::BatchResourceSpec::recorded(crate::batches::BatchSpec {
                id: crate::ids::BatchId::generate(),
                project_id: crate::ids::ProjectId::generate(),
                input_file_id: crate::ids::FileId::generate(),
                endpoint: "/v1/chat/completions".into(),
                completion_window: "24h".into(),
                metadata: Default::default(),
                created_at: 1,
                expires_at: 2,
                model: None,
                output_expires_after: None,
                priority: None,
                plan: Default::default(),
            }),
        );
        let mut state = crate::batches::BatchState::in_progress(1, 3);
        state.shard_failures.insert(0, 2);
        resource.status = Some(state);
        let guard: DeserializeGuard<BatchResource> =
            serde_json::from_value(serde_json::to_value(&resource).unwrap()).unwrap();
        assert_eq!(guard.0.expect("decodes").status.unwrap().shard_failures.get(&0), Some(&2));
    }

    #[test]
    fn an_object_that_fails_to_decode_is_reported_and_left_out() {
        let mut reported = Vec::new();
        let bad = guard(json!({"id": "../x"}));
        let event = split(Event::Apply(bad.clone()), &mut |invalid| reported.push(invalid));
        assert!(event.is_none(), "left out of the cache");
        assert_eq!(reported.len(), 1);
        assert_eq!(reported[0].metadata.name.as_deref(), Some("batch-x"));
        assert!(split(Event::InitApply(bad.clone()), &mut |invalid| reported.push(invalid)).is_none());
        assert_eq!(reported.len(), 2);
        assert!(split(Event::Delete(bad), &mut |invalid| reported.push(invalid)).is_none());
        assert_eq!(reported.len(), 2, "a deletion is not reported");
        assert!(matches!(split::<BatchResource>(Event::InitDone, &mut |_| panic!()), Some(Event::InitDone)));
    }
}
