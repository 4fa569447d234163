//! Where `nightshift serve` finds its S3 credentials, for real: the AWS SDK's default
//! chain (environment keys; a shared credentials file; web identity through an STS
//! stand-in of our own, with credentials that expire and are refreshed while a batch
//! runs), and static keys under names of one's own. Every case runs a batch against
//! s3s-fs, which accepts only the right keys.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::client::Client;
use common::process::{Process, spawn};
use common::sts::Sts;
use common::{KEY, PROJECT, S3_ACCESS_KEY, S3_SECRET_KEY, TestS3, write_config};
use tempfile::TempDir;

/// `nightshift serve` on `s3` with the credentials `settings` and `env` give.
fn serve(dir: &Path, s3: &TestS3, settings: &str, env: &[(&str, String)]) -> (Process, Client) {
    let config = write_config(
        dir,
        &format!(
            "storage:\n  s3: {{bucket: {}, endpoint: \"{}\", path_style: true{settings}}}\n",
            s3.bucket, s3.endpoint
        ),
    );
    // Nothing of this machine's own AWS settings reaches the chain.
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("HOME", dir.display().to_string()));
    env.push(("AWS_EC2_METADATA_DISABLED", "true".into()));
    let args =
        ["serve", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    let (process, line) = spawn(&args, &env, "listening on", &dir.join("serve.log"));
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned();
    (process, Client::new(&url, PROJECT, KEY))
}

/// A batch of `lines` through the API: files and results go through S3.
async fn run_batch(client: &Client, lines: usize) {
    let body: String = (0..lines)
        .map(|n| {
            format!(
                "{{\"custom_id\":\"c-{n}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\
                 \"body\":{{\"model\":\"echo\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi {n}\"}}]}}}}\n"
            )
        })
        .collect();
    let file = client.upload(body.into_bytes()).await;
    let batch = client.create(&file).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(batch["request_counts"]["completed"], lines);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_chain_takes_keys_from_the_environment() {
    let (s3, dir) = (TestS3::start(), TempDir::new().unwrap());
    let env = [("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY.to_owned()), ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY.to_owned())];
    let (_serve, client) = serve(dir.path(), &s3, "", &env);
    run_batch(&client, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_chain_takes_keys_from_a_shared_credentials_file() {
    let (s3, dir) = (TestS3::start(), TempDir::new().unwrap());
    let credentials = dir.path().join("credentials");
    std::fs::write(
        &credentials,
        format!("[batch]\naws_access_key_id = {S3_ACCESS_KEY}\naws_secret_access_key = {S3_SECRET_KEY}\n"),
    )
    .unwrap();
    let env = [
        ("AWS_SHARED_CREDENTIALS_FILE", credentials.display().to_string()),
        ("AWS_CONFIG_FILE", dir.path().join("no-config").display().to_string()),
        ("AWS_PROFILE", "batch".to_owned()),
    ];
    let (_serve, client) = serve(dir.path(), &s3, "", &env);
    run_batch(&client, 5).await;
}

/// IRSA, as EKS sets it up: a projected token file and a role; the SDK trades the token
/// for keys at STS, and again before they expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_identity_credentials_come_from_sts_and_are_refreshed_before_they_expire() {
    let (s3, dir) = (TestS3::start(), TempDir::new().unwrap());
    let role = "arn:aws:iam::123456789012:role/nightshift";
    let token = "eyJhbGciOiJSUzI1NiJ9.test-token.signature";
    // The SDK refreshes credentials within a few seconds of their expiry: these last 12 s.
    let sts = Sts::start(token, role, Duration::from_secs(12)).await;
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token).unwrap();
    let env = [
        ("AWS_WEB_IDENTITY_TOKEN_FILE", token_file.display().to_string()),
        ("AWS_ROLE_ARN", role.to_owned()),
        ("AWS_ROLE_SESSION_NAME", "nightshift-test".to_owned()),
        ("AWS_ENDPOINT_URL_STS", sts.url.clone()),
        ("AWS_REGION", "us-east-1".to_owned()),
    ];
    let (_serve, client) = serve(dir.path(), &s3, "", &env);
    run_batch(&client, 5).await;
    assert!(sts.calls() >= 1, "the keys came from STS");
    // Keep storage busy past the first credentials' lifetime.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(15) {
        run_batch(&client, 3).await;
    }
    assert!(sts.calls() >= 2, "expiring credentials were refreshed: {} STS calls", sts.calls());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_keys_under_names_of_ones_own_override_the_chain() {
    let (s3, dir) = (TestS3::start(), TempDir::new().unwrap());
    let env = [
        ("STORE_KEY", S3_ACCESS_KEY.to_owned()),
        ("STORE_SECRET", S3_SECRET_KEY.to_owned()),
        // Wrong keys where the chain would look first: the override must win.
        ("AWS_ACCESS_KEY_ID", "wrong".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "wrong".to_owned()),
    ];
    let settings = ", access_key_id_env: STORE_KEY, secret_access_key_env: STORE_SECRET";
    let (_serve, client) = serve(dir.path(), &s3, settings, &env);
    run_batch(&client, 5).await;
}
