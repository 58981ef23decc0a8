//! RedisStore over TLS against real redis-servers that speak only TLS, with certificates
//! this test makes: a single server (a custom CA; a client certificate where the server asks
//! for one; ACL credentials) and a 3-master Cluster; a wrong CA and wrong credentials are
//! refused with errors that say what to change; and a store built from a connection the
//! application made itself.

#![cfg(feature = "redis-tls")]

mod support;

use std::time::Duration;

use support::tls::{Certs, TlsCluster, TlsServer};
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, Cost, Limiter, Policy, StoreError, SystemClock};

const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 600, per = "1m" }
lease = "off"
[tool.default_tenant]
ceiling = 5
burst = 5
"#;

/// Five calls of one tenant admitted, the sixth refused: decided in Redis over TLS.
async fn five_then_refused(store: RedisStore) {
    let limiter = Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, SystemClock);
    let acme = Caller::new("acme");
    for k in 0..5 {
        let t = limiter.admit(&acme, "search", Cost(1.0)).await;
        assert!(t.is_ok(), "call {k}: {t:?}");
    }
    let r = limiter.admit(&acme, "search", Cost(1.0)).await.unwrap_err();
    assert_eq!(r.reason.as_str(), "rate_limited", "{r:?}");
    assert_eq!(limiter.store().errors(), 0);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn unavailable(r: Result<RedisStore, StoreError>) -> String {
    match r {
        Err(StoreError::Unavailable(why)) => why,
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("connected where it must not"),
    }
}

#[test]
fn a_single_server_with_a_custom_ca_and_a_client_certificate() {
    let certs = Certs::make();
    let server = TlsServer::start(&certs, true, &[]);
    runtime().block_on(async {
        let store = RedisStore::builder(server.url())
            .ca_certificate_pem(certs.pem("ca.crt"))
            .client_certificate_pem(certs.pem("client.crt"), certs.pem("client.key"))
            .connect()
            .await
            .expect("connect over TLS");
        five_then_refused(store).await;

        // The server asks for a client certificate: without one the handshake fails.
        let why = unavailable(
            RedisStore::builder(server.url())
                .ca_certificate_pem(certs.pem("ca.crt"))
                .timeout(Duration::from_millis(500))
                .connect()
                .await,
        );
        println!("without a client certificate: {why}");
        assert!(why.contains("client_certificate_pem"), "{why}");
    });
    // The decisions' records are in this server, written over TLS.
    let keys = server.cli(&certs, &["DBSIZE"]);
    assert!(keys.trim().parse::<u64>().unwrap() > 0, "{keys}");
}

#[test]
fn a_wrong_ca_is_refused_with_an_error_that_names_it() {
    let certs = Certs::make();
    let server = TlsServer::start(&certs, false, &[]);
    runtime().block_on(async {
        let why = unavailable(
            RedisStore::builder(server.url())
                .ca_certificate_pem(certs.pem("other-ca.crt"))
                .timeout(Duration::from_millis(500))
                .connect()
                .await,
        );
        println!("wrong CA: {why}");
        assert!(
            why.contains("not signed by a trusted authority") && why.contains("ca_certificate_pem"),
            "{why}"
        );
        // The system's roots do not know the test CA either.
        let why = unavailable(
            RedisStore::builder(server.url())
                .timeout(Duration::from_millis(500))
                .connect()
                .await,
        );
        assert!(why.contains("not signed by a trusted authority"), "{why}");
        // Certificates for a plain address are a mistake, said before anything is sent.
        let why = unavailable(
            RedisStore::builder(format!("redis://127.0.0.1:{}/", server.port))
                .ca_certificate_pem(certs.pem("ca.crt"))
                .connect()
                .await,
        );
        assert!(why.contains("use `rediss://`"), "{why}");
    });
}

#[test]
fn acl_credentials_over_tls() {
    let certs = Certs::make();
    let server = TlsServer::start(&certs, false, &[]);
    let set = server.cli(
        &certs,
        &[
            "ACL", "SETUSER", "limiter", "on", ">s3cret", "~*", "&*", "+@all",
        ],
    );
    assert_eq!(set.trim(), "OK");
    let off = server.cli(&certs, &["ACL", "SETUSER", "default", "off"]);
    assert_eq!(off.trim(), "OK");
    runtime().block_on(async {
        let store = RedisStore::builder(server.url())
            .ca_certificate_pem(certs.pem("ca.crt"))
            .credentials(Some("limiter"), "s3cret")
            .connect()
            .await
            .expect("connect as the ACL user");
        five_then_refused(store).await;

        let why = unavailable(
            RedisStore::builder(server.url())
                .ca_certificate_pem(certs.pem("ca.crt"))
                .credentials(Some("limiter"), "wrong")
                .timeout(Duration::from_millis(500))
                .connect()
                .await,
        );
        println!("wrong password: {why}");
        assert!(why.contains("refused the credentials"), "{why}");

        // The same user in the URL.
        let url = format!("rediss://limiter:s3cret@127.0.0.1:{}/", server.port);
        let store = RedisStore::builder(url)
            .ca_certificate_pem(certs.pem("ca.crt"))
            .connect()
            .await
            .expect("credentials in the URL");
        let limiter =
            Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, SystemClock);
        assert!(limiter
            .admit(&Caller::new("globex"), "search", Cost(1.0))
            .await
            .is_ok());
    });
}

#[test]
fn a_store_over_the_applications_own_connection() {
    let certs = Certs::make();
    let server = TlsServer::start(&certs, false, &[]);
    runtime().block_on(async {
        let client = redis::Client::build_with_tls(
            server.url().as_str(),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(certs.pem("ca.crt")),
            },
        )
        .unwrap();
        let connection = redis::aio::ConnectionManager::new(client).await.unwrap();
        let store = RedisStore::from_connection(connection)
            .connect()
            .await
            .unwrap();
        five_then_refused(store).await;
    });
}

#[test]
fn a_cluster_over_tls() {
    let certs = Certs::make();
    let cluster = TlsCluster::start(&certs);
    runtime().block_on(async {
        let store = RedisStore::cluster_builder(cluster.urls())
            .ca_certificate_pem(certs.pem("ca.crt"))
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("connect to the TLS cluster");
        five_then_refused(store).await;
    });
}
