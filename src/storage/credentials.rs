//! Where the S3 store's credentials come from: static keys (an S3-compatible server with
//! an access key pair), or the AWS SDK's default chain: environment variables, the shared
//! config and credentials files, web identity (IRSA on EKS: `AWS_WEB_IDENTITY_TOKEN_FILE`
//! and `AWS_ROLE_ARN`, via STS), container credentials (EKS Pod Identity, ECS) and the
//! instance metadata service, refreshed before they expire.

use aws_config::default_provider::credentials::DefaultCredentialsChain;
use aws_credential_types::Credentials;
use aws_credential_types::provider::{self, ProvideCredentials, SharedCredentialsProvider};
use aws_sdk_s3::config::Region;
use tokio::sync::OnceCell;

/// An access key pair given in full.
#[derive(Clone, Debug)]
pub struct StaticKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

/// The provider for `keys`, or the default chain when there are none.
pub fn provider(keys: Option<StaticKeys>, region: &str) -> SharedCredentialsProvider {
    match keys {
        Some(keys) => SharedCredentialsProvider::new(Credentials::new(
            keys.access_key_id,
            keys.secret_access_key,
            keys.session_token,
            None,
            "nightshift-config",
        )),
        None => {
            SharedCredentialsProvider::new(LazyChain { region: Region::new(region.to_owned()), chain: OnceCell::new() })
        }
    }
}

/// The default chain, built on first use (building it is asynchronous: it reads the
/// profile files). The S3 client caches what it provides until shortly before expiry.
#[derive(Debug)]
struct LazyChain {
    region: Region,
    chain: OnceCell<DefaultCredentialsChain>,
}

impl ProvideCredentials for LazyChain {
    fn provide_credentials<'a>(&'a self) -> provider::future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        provider::future::ProvideCredentials::new(async move {
            let chain =
                self.chain.get_or_init(|| DefaultCredentialsChain::builder().region(self.region.clone()).build()).await;
            chain.provide_credentials().await
        })
    }
}
