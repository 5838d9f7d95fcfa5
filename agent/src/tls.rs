//! TLS to the collector: which CA to trust, and the client certificate for
//! a collector that requires mutual TLS. Files are read once at start, and a
//! missing or unreadable one is an error that names it.

use std::path::PathBuf;

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

pub use headroom_common::tls::{TlsError, read_pem};

/// Where the agent's TLS material is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// CA bundle to trust; the system's roots when absent.
    pub ca: Option<PathBuf>,
    /// Client certificate chain and key, for mutual TLS.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Name the collector's certificate must carry (default: the URL's host).
    pub server_name: Option<String>,
}

impl ClientTlsFiles {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The TLS settings for an `https://` collector URL.
    pub fn load(&self) -> Result<ClientTlsConfig, TlsError> {
        let mut config = ClientTlsConfig::new();
        config = match &self.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read_pem(ca, "tls_ca_file")?)),
            None => config.with_native_roots(),
        };
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                config = config.identity(Identity::from_pem(
                    read_pem(cert, "tls_cert_file")?,
                    read_pem(key, "tls_key_file")?,
                ));
            }
            (None, None) => {}
            _ => {
                return Err(TlsError::Invalid(
                    "tls_cert_file and tls_key_file go together (mutual TLS)".into(),
                ));
            }
        }
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        Ok(config)
    }
}
