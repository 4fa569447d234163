//! End to end with the official OpenAI Python SDK against `nightshift serve`.

use crate::common;

use std::process::Command;

use common::serve::Serve;
use tempfile::TempDir;

fn run_python(script: &str, serve: &Serve) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(common::tools::python())
        .arg(format!("{root}/{script}"))
        .env("NIGHTSHIFT_URL", &serve.url)
        .env("NIGHTSHIFT_DATA_DIR", &serve.data_dir)
        .env("NIGHTSHIFT_PROJECT_ID", serve.project_id.as_deref().unwrap_or_default())
        .env("NIGHTSHIFT_API_KEY", serve.api_key.as_deref().unwrap_or_default())
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/must-not-be-used")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    stdout
}

/// Runs `script` with the SDK configured only by its own environment variables
/// (`OPENAI_BASE_URL`, `OPENAI_API_KEY` = `key`), plus `env`; returns its stdout.
fn run_python_configured_by_env(script: &str, serve: &Serve, key: &str, env: &[(&str, &str)]) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(common::tools::python())
        .arg(format!("{root}/{script}"))
        .env("OPENAI_BASE_URL", format!("{}/v1", serve.url))
        .env("OPENAI_API_KEY", key)
        .envs(env.iter().copied())
        .env_remove("OPENAI_PROJECT_ID")
        .env_remove("OPENAI_ORG_ID")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    stdout
}

#[test]
fn quickstart_uploads_a_file_and_creates_a_batch() {
    let data = TempDir::new().unwrap();
    let serve = Serve::start(data.path(), &[]);
    let stdout = run_python("examples/quickstart.py", &serve);
    assert!(stdout.contains("ours is among them: True"), "{stdout}");
    assert!(stdout.contains("identical bytes"), "{stdout}");
    assert!(stdout.contains("created batch batch_"), "{stdout}");
    assert!(stdout.contains("is completed: 3 completed, 0 failed of 3"), "{stdout}");
    assert!(stdout.contains("req-1: What is the capital of France?"), "{stdout}");
}

#[test]
fn quickstart_finds_the_dev_credentials_without_being_told() {
    let data = TempDir::new().unwrap();
    let mut serve = Serve::start(data.path(), &[]);
    serve.project_id = None;
    serve.api_key = None;
    run_python("examples/quickstart.py", &serve);
}

#[test]
fn the_sdk_sees_files_pagination_and_typed_errors() {
    let data = TempDir::new().unwrap();
    let serve = Serve::start(data.path(), &[]);
    let stdout = run_python("tests/e2e/files_sdk.py", &serve);
    assert!(stdout.contains("files SDK checks passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_creates_retrieves_lists_runs_and_cancels_batches() {
    let upstream = common::upstream::MockUpstream::start().await;
    upstream.delay(std::time::Duration::from_millis(200));
    let data = TempDir::new().unwrap();
    let config = common::write_config(
        data.path(),
        &format!(
            "upstreams:\n  - name: slow\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 1\n\
             batches:\n  reconcile_interval: 100ms\n  cancel_grace: 5s\n",
            upstream.base_url
        ),
    );
    let mut serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    serve.project_id = Some(common::PROJECT.into());
    serve.api_key = Some(common::KEY.into());
    let stdout = tokio::task::spawn_blocking(move || run_python("tests/e2e/batches_sdk.py", &serve)).await.unwrap();
    assert!(stdout.contains("batches SDK checks passed"), "{stdout}");
}

/// `OpenAI()` with only `OPENAI_BASE_URL` and `OPENAI_API_KEY` set: the bearer key names
/// its project, no extra header needed; expiry options; an embeddings batch.
#[test]
fn the_sdk_works_configured_only_by_its_environment_variables() {
    let data = TempDir::new().unwrap();
    // No projects configured (the dev project), and embeddings enabled for batches.
    let config = data.path().join("endpoints.yaml");
    std::fs::write(&config, "batches:\n  endpoints: [/v1/chat/completions, /v1/embeddings]\n").unwrap();
    let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    let (key, project) = (serve.api_key.clone().unwrap(), serve.project_id.clone().unwrap());
    let stdout =
        run_python_configured_by_env("tests/e2e/env_sdk.py", &serve, &key, &[("NIGHTSHIFT_PROJECT_ID", &project)]);
    assert!(stdout.contains("environment-only SDK checks passed"), "{stdout}");
}

/// A 150 MB input (past the 100 MB file limit) through `client.uploads.upload_file_chunked`
/// in 64 MB parts, then run as a batch; and the Uploads API's refusals as typed errors.
#[test]
fn the_sdk_uploads_a_150_mb_input_in_parts_and_runs_it() {
    let data = TempDir::new().unwrap();
    let serve = Serve::start(&data.path().join("data"), &[]);
    let key = serve.api_key.clone().unwrap();
    let stdout = run_python_configured_by_env("tests/e2e/uploads_sdk.py", &serve, &key, &[]);
    assert!(stdout.contains("in 3 parts"), "{stdout}");
    assert!(stdout.contains("uploads SDK checks passed"), "{stdout}");
}

/// A batch's `batch.completed` webhook, retried after a 500 with the same id, verified
/// and typed by `client.webhooks.unwrap(...)`.
#[test]
fn the_sdk_verifies_a_batch_webhook() {
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let data = TempDir::new().unwrap();
    let port = common::ports::claim_one();
    let config = common::write_config(
        data.path(),
        &format!(
            "    webhooks: [{{url: \"http://127.0.0.1:{port}/hook\", secret: {SECRET}}}]\n\
             webhooks: {{allowed_hosts: [127.0.0.1]}}\n"
        ),
    );
    let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    let port = port.to_string();
    let env = [("WEBHOOK_PORT", port.as_str()), ("WEBHOOK_SECRET", SECRET)];
    let stdout = run_python_configured_by_env("tests/e2e/webhooks_sdk.py", &serve, common::KEY, &env);
    assert!(stdout.contains("webhooks SDK checks passed"), "{stdout}");
}

#[tokio::test]
async fn a_restarted_serve_keeps_its_dev_project_and_files() {
    let data = TempDir::new().unwrap();
    let first = Serve::start(data.path(), &[]);
    let (project, key) = (first.project_id.clone().unwrap(), first.api_key.clone().unwrap());
    let client = common::client::Client::new(&first.url, &project, &key);
    let id = client.upload(b"{}\n".to_vec()).await;
    let uploaded = client.file(&id).await;
    first.kill();

    let second = Serve::start(data.path(), &[]);
    assert_eq!(second.project_id.as_deref(), Some(project.as_str()));
    assert_eq!(second.api_key.as_deref(), Some(key.as_str()));
    let retrieved = common::client::Client::new(&second.url, &project, &key).file(&id).await;
    assert_eq!(retrieved, uploaded);
}

/// The SDK's batch through `serve` to a real model server, llama.cpp's llama-server, with
/// its load signal found beside its API (none configured) and read through the
/// `llamacpp` preset: every line answered once, the batch's usage the sum of the engine's
/// own counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_batch_runs_on_a_real_engine_and_sums_its_usage() {
    let engine = common::engine::LlamaServer::start("tiny", 4).await;
    let data = TempDir::new().unwrap();
    let config = common::write_config(
        data.path(),
        &format!(
            "upstreams:\n  - name: llama\n    base_url: {url}/v1\n    models: [\"{model}\"]\n    max_concurrency: 16\nbatches:\n  reconcile_interval: 100ms\n",
            url = engine.url,
            model = engine.alias,
        ),
    );
    let mut serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    serve.project_id = Some(common::PROJECT.into());
    serve.api_key = Some(common::KEY.into());
    let metrics_url = serve.metrics_url.clone();
    let model = engine.alias.clone();
    let stdout = tokio::task::spawn_blocking(move || {
        let root = env!("CARGO_MANIFEST_DIR");
        let output = Command::new(common::tools::python())
            .arg(format!("{root}/tests/e2e/engine_sdk.py"))
            .env("NIGHTSHIFT_URL", &serve.url)
            .env("NIGHTSHIFT_PROJECT_ID", common::PROJECT)
            .env("NIGHTSHIFT_API_KEY", common::KEY)
            .env("ENGINE_MODEL", model)
            .env("LINES", "40")
            .env("MAX_TOKENS", "12")
            .output()
            .expect("python runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "engine_sdk.py failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        (stdout, serve)
    })
    .await
    .unwrap();
    let (stdout, _serve) = stdout;
    eprintln!("{stdout}");
    assert!(stdout.contains("engine SDK checks passed"), "{stdout}");
    // The signal was found, and the preset read llama-server's own exposition: it set a
    // cap, and never failed.
    let found = "nightshift_load_signal_info{upstream=\"llama\",server=\"llamacpp\",source=\"found\"}";
    let metrics = reqwest::get(&metrics_url).await.unwrap().text().await.unwrap();
    let value = |series: &str| {
        metrics
            .lines()
            .find(|line| line.starts_with(series))
            .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(value(found), Some(1.0), "{metrics}");
    assert!(value("nightshift_upstream_concurrency_limit{upstream=\"llama\"}").is_some(), "{metrics}");
    assert_eq!(value("nightshift_load_signal_failures_total{upstream=\"llama\"}").unwrap_or(0.0), 0.0, "{metrics}");
}
