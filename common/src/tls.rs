//! PEM files for TLS: read once at start, and a missing, unreadable or
//! non-PEM file is an error that names the file and what it was for.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} ({what}) holds no PEM block")]
    NotPem { what: &'static str, path: PathBuf },
    #[error("{0}")]
    Invalid(String),
}

/// Reads a PEM file, checking that it is one.
pub fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(TlsError::NotPem {
            what,
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}
