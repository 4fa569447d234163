//! Token quotas: how much each project has used, per batch, and whether it has room.
//!
//! Usage is known two ways: live, as workers see lines succeed, and durably, from
//! the checkpoints that the reconcile loop reads (and from batch documents after a
//! restart). For each batch the ledger keeps the larger of the two, so a restart
//! neither loses committed usage nor counts a line twice.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::auth::Projects;
use crate::ids::{BatchId, ProjectId};

#[derive(Default)]
struct ProjectUsage {
    total: u64,
    by_batch: HashMap<BatchId, u64>,
    /// Usage known for the project as a whole (a Project resource's status).
    floor: u64,
}

#[derive(Default)]
pub struct QuotaLedger {
    limits: Mutex<HashMap<ProjectId, u64>>,
    used: Mutex<HashMap<ProjectId, ProjectUsage>>,
}

impl QuotaLedger {
    pub fn new(projects: &Projects) -> Self {
        let ledger = Self::default();
        ledger.set_limits(projects);
        ledger
    }

    /// A ledger for one project that may use `limit` more tokens (a worker's view).
    pub fn single(project: &ProjectId, limit: Option<u64>) -> Self {
        Self { limits: Mutex::new(limit.map(|l| (project.clone(), l)).into_iter().collect()), used: Mutex::default() }
    }

    /// Takes the quotas of `projects` (they changed).
    pub fn set_limits(&self, projects: &Projects) {
        *self.limits.lock().expect("quota limits") = projects.quotas().collect();
    }

    /// Durable: the project is known to have used `tokens` in all.
    pub fn observe_project(&self, project: &ProjectId, tokens: u64) {
        let mut used = self.used.lock().expect("quota ledger");
        let usage = used.entry(project.clone()).or_default();
        usage.floor = usage.floor.max(tokens);
    }

    /// Tokens the project has used, over all its batches.
    pub fn used(&self, project: &ProjectId) -> u64 {
        self.used.lock().expect("quota ledger").get(project).map_or(0, |usage| usage.total.max(usage.floor))
    }

    /// Whether the project may spend more tokens (always, without a quota).
    pub fn has_room(&self, project: &ProjectId) -> bool {
        let limit = self.limits.lock().expect("quota limits").get(project).copied();
        limit.is_none_or(|limit| self.used(project) < limit)
    }

    /// Live: a line of `batch` just used `tokens`.
    pub fn charge(&self, project: &ProjectId, batch: &BatchId, tokens: u64) {
        let mut used = self.used.lock().expect("quota ledger");
        // Called once per line: look up before cloning keys into the maps.
        if !used.contains_key(project) {
            used.insert(project.clone(), ProjectUsage::default());
        }
        let usage = used.get_mut(project).expect("inserted above");
        match usage.by_batch.get_mut(batch) {
            Some(known) => *known += tokens,
            None => {
                usage.by_batch.insert(batch.clone(), tokens);
            }
        }
        usage.total += tokens;
    }

    /// Durable: `batch` is known to have used `tokens` in all.
    pub fn observe(&self, project: &ProjectId, batch: &BatchId, tokens: u64) {
        let mut used = self.used.lock().expect("quota ledger");
        let usage = used.entry(project.clone()).or_default();
        let known = usage.by_batch.entry(batch.clone()).or_default();
        if tokens > *known {
            usage.total += tokens - *known;
            *known = tokens;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ApiKeyConfig, ProjectConfig, QuotaConfig};

    #[test]
    fn live_and_durable_usage_merge_without_double_counting() {
        let project = ProjectId::generate();
        let projects = Projects::from_config(&[ProjectConfig {
            id: project.clone(),
            name: None,
            api_keys: vec![ApiKeyConfig { plain: Some("k".into()), sha256: None, active: true }],
            quota: Some(QuotaConfig { tokens: 100 }),
        }]);
        let ledger = QuotaLedger::new(&projects);
        let (a, b) = (BatchId::generate(), BatchId::generate());
        ledger.observe(&project, &a, 40);
        ledger.charge(&project, &a, 10);
        ledger.observe(&project, &a, 45);
        assert_eq!(ledger.used(&project), 50, "durable 45 is behind live 50");
        ledger.observe(&project, &a, 60);
        ledger.charge(&project, &b, 30);
        assert_eq!(ledger.used(&project), 90);
        assert!(ledger.has_room(&project));
        ledger.charge(&project, &b, 10);
        assert!(!ledger.has_room(&project));
        assert!(ledger.has_room(&ProjectId::generate()), "no quota, no limit");
    }
}
