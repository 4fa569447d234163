//! A scriptable stand-in for AWS STS, answering `AssumeRoleWithWebIdentity` (the call
//! behind IRSA on EKS) with the test S3 server's keys, expiring soon so that clients
//! must refresh them while a test runs. It checks the web identity token it is sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;

pub struct Sts {
    pub url: String,
    shared: Arc<Shared>,
}

struct Shared {
    token: String,
    role_arn: String,
    lifetime: Duration,
    calls: AtomicU64,
}

impl Sts {
    /// Accepts `token` for `role_arn`; hands out `keys` valid for `lifetime`.
    pub async fn start(token: &str, role_arn: &str, lifetime: Duration) -> Sts {
        let shared = Arc::new(Shared {
            token: token.to_owned(),
            role_arn: role_arn.to_owned(),
            lifetime,
            calls: AtomicU64::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let router = axum::Router::new().route("/", axum::routing::post(answer)).with_state(shared.clone());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Sts { url, shared }
    }

    /// How many credentials were handed out.
    pub fn calls(&self) -> u64 {
        self.shared.calls.load(Ordering::SeqCst)
    }
}

async fn answer(State(shared): State<Arc<Shared>>, body: String) -> impl IntoResponse {
    let form: HashMap<String, String> = url_decoded(&body);
    let field = |name: &str| form.get(name).map(String::as_str).unwrap_or_default();
    if field("Action") != "AssumeRoleWithWebIdentity" {
        return (StatusCode::BAD_REQUEST, error("InvalidAction", "only AssumeRoleWithWebIdentity"));
    }
    if field("WebIdentityToken") != shared.token || field("RoleArn") != shared.role_arn {
        return (StatusCode::FORBIDDEN, error("AccessDenied", "not this token for this role"));
    }
    shared.calls.fetch_add(1, Ordering::SeqCst);
    let expires = k8s_openapi::jiff::Timestamp::now().checked_add(shared.lifetime).unwrap();
    let expiration = expires.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let xml = format!(
        r#"<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <SubjectFromWebIdentityToken>system:serviceaccount:nightshift:nightshift-worker</SubjectFromWebIdentityToken>
    <AssumedRoleUser>
      <Arn>{role}/{session}</Arn>
      <AssumedRoleId>AROATEST:{session}</AssumedRoleId>
    </AssumedRoleUser>
    <Credentials>
      <AccessKeyId>{key}</AccessKeyId>
      <SecretAccessKey>{secret}</SecretAccessKey>
      <SessionToken>session-{n}</SessionToken>
      <Expiration>{expiration}</Expiration>
    </Credentials>
  </AssumeRoleWithWebIdentityResult>
  <ResponseMetadata><RequestId>sts-{n}</RequestId></ResponseMetadata>
</AssumeRoleWithWebIdentityResponse>"#,
        role = shared.role_arn,
        session = field("RoleSessionName"),
        key = super::S3_ACCESS_KEY,
        secret = super::S3_SECRET_KEY,
        n = shared.calls.load(Ordering::SeqCst),
    );
    (StatusCode::OK, xml)
}

fn error(code: &str, message: &str) -> String {
    format!(
        "<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>\
         <RequestId>sts-error</RequestId></ErrorResponse>"
    )
}

/// A form body (`a=b&c=d`, URL-encoded), decoded.
fn url_decoded(body: &str) -> HashMap<String, String> {
    let url = reqwest::Url::parse(&format!("http://sts.test/?{body}")).unwrap();
    url.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect()
}
