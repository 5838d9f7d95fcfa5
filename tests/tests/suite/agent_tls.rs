//! gRPC over TLS between agent and collector, with certificates made for the
//! test: an agent that trusts the collector's CA streams; a plaintext client
//! and one that trusts another CA do not get in; with mutual TLS, an agent
//! without a client certificate is refused and one with it streams.

use std::path::{Path, PathBuf};
use std::time::Duration;

use headroom_agent::AgentSettings;
use headroom_agent::source::SimSource;
use headroom_agent::tls::ClientTlsFiles;
use headroom_collector::Collector;
use headroom_collector::config::TlsConfig;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_sim::Scenario;
use headroom_tests::fixtures::{self, BOOT, NODE};
use headroom_tests::harness::{RunningCollector, sim_agent_settings};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// A CA, a server certificate for localhost, a client certificate, and a
/// second CA nobody should trust.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    (pem, Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
    dir: &Path,
    stem: &str,
) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(DnType::CommonName, names[0]);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    std::fs::write(dir.join(format!("{stem}.crt")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{stem}.key")), key.serialize_pem()).unwrap();
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let (ca_pem, issuer) = ca("Headroom test CA");
    std::fs::write(dir.path().join("ca.crt"), ca_pem).unwrap();
    leaf(
        &issuer,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
        dir.path(),
        "server",
    );
    leaf(
        &issuer,
        &["gpu-node-01"],
        ExtendedKeyUsagePurpose::ClientAuth,
        dir.path(),
        "client",
    );
    let (other_pem, _) = ca("Someone else's CA");
    std::fs::write(dir.path().join("other-ca.crt"), other_pem).unwrap();
    Pki { dir }
}

async fn tls_collector(pki: &Pki, mutual: bool) -> (RunningCollector, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tls.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let tls = TlsConfig {
        cert_file: Some(pki.path("server.crt")),
        key_file: Some(pki.path("server.key")),
        client_ca_file: mutual.then(|| pki.path("ca.crt")),
    }
    .server_config()
    .unwrap()
    .expect("a certificate and key make a TLS config");
    let collector = Collector::builder(store).tls(tls).build().await.unwrap();
    (RunningCollector::start_collector(collector).await, dir)
}

fn https_url(c: &RunningCollector) -> String {
    format!("https://localhost:{}", c.grpc_addr.port())
}

fn client_tls(pki: &Pki, ca: &str, with_certificate: bool) -> ClientTlsConfig {
    ClientTlsFiles {
        ca: Some(pki.path(ca)),
        cert: with_certificate.then(|| pki.path("client.crt")),
        key: with_certificate.then(|| pki.path("client.key")),
        server_name: None,
    }
    .load()
    .unwrap()
}

/// Whether a raw client with `tls` gets a `Register` through.
async fn registers(url: &str, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).unwrap();
    }
    let channel: Channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    IngestClient::new(channel)
        .register(fixtures::register(NODE, BOOT))
        .await
        .map(|_| ())
        .map_err(|status| format!("{status:?}"))
}

async fn agent_streams(c: &RunningCollector, tls: ClientTlsConfig) {
    let agent = headroom_agent::start(
        AgentSettings {
            tls: Some(tls),
            ..sim_agent_settings(https_url(c), "gpu-node-01")
        },
        Box::new(SimSource::new(&Scenario::demo(), "gpu-node-01").unwrap()),
    )
    .unwrap();
    c.wait_for_samples("samples over TLS").await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_stream_over_tls_and_plaintext_or_a_foreign_ca_is_refused() {
    let pki = pki();
    let (collector, _db) = tls_collector(&pki, false).await;
    agent_streams(&collector, client_tls(&pki, "ca.crt", false)).await;

    let plaintext = registers(&collector.grpc_url(), None).await;
    assert!(plaintext.is_err(), "plaintext got in: {plaintext:?}");
    let foreign = registers(
        &https_url(&collector),
        Some(client_tls(&pki, "other-ca.crt", false)),
    )
    .await;
    let error = foreign.unwrap_err();
    assert!(
        error.contains("certificate")
            || error.contains("Certificate")
            || error.contains("UnknownIssuer"),
        "refused for its certificate: {error}"
    );
    collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_an_agent_without_a_client_certificate() {
    let pki = pki();
    let (collector, _db) = tls_collector(&pki, true).await;
    let anonymous = registers(
        &https_url(&collector),
        Some(client_tls(&pki, "ca.crt", false)),
    )
    .await;
    assert!(
        anonymous.is_err(),
        "no client certificate, yet: {anonymous:?}"
    );
    assert_eq!(
        registers(
            &https_url(&collector),
            Some(client_tls(&pki, "ca.crt", true))
        )
        .await,
        Ok(())
    );
    agent_streams(&collector, client_tls(&pki, "ca.crt", true)).await;
    collector.stop().await;
}

#[test]
fn a_tls_file_that_is_missing_or_not_pem_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = TlsConfig {
        cert_file: Some(dir.path().join("nope.crt")),
        key_file: Some(dir.path().join("nope.key")),
        client_ca_file: None,
    }
    .server_config()
    .unwrap_err()
    .to_string();
    assert!(missing.contains("nope.crt"), "{missing}");
    std::fs::write(dir.path().join("junk.crt"), "not a certificate").unwrap();
    let junk = ClientTlsFiles {
        ca: Some(dir.path().join("junk.crt")),
        ..ClientTlsFiles::default()
    }
    .load()
    .unwrap_err()
    .to_string();
    assert!(junk.contains("junk.crt") && junk.contains("PEM"), "{junk}");
}
