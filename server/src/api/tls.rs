//! HTTPS for `--ssl-key-file` and `--ssl-cert-file`, as llama-server built with OpenSSL serves it:
//! a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1), TLS 1.2 and 1.3,
//! HTTP/1.1 inside. rustls with the aws-lc-rs provider: no OpenSSL to link.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use tokio_rustls::TlsAcceptor;

/// Why the key and certificate cannot serve; start-up stops with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--ssl-key-file and --ssl-cert-file go together: only {0} was given")]
    Half(&'static str),
    #[error("--ssl-cert-file {path}: {why}")]
    Cert { path: String, why: String },
    #[error("--ssl-key-file {path}: {why}")]
    Key { path: String, why: String },
    #[error("--ssl-key-file and --ssl-cert-file do not make a TLS server: {0}")]
    Config(String),
}

/// The acceptor for the key and certificate files, `None` when neither is given.
pub fn acceptor(key: &str, cert: &str) -> Result<Option<TlsAcceptor>, TlsError> {
    match (key.is_empty(), cert.is_empty()) {
        (true, true) => return Ok(None),
        (false, true) => return Err(TlsError::Half("--ssl-key-file")),
        (true, false) => return Err(TlsError::Half("--ssl-cert-file")),
        (false, false) => {}
    }
    let certs = read_certs(Path::new(cert)).map_err(|why| TlsError::Cert { path: cert.to_string(), why })?;
    let key_der = read_key(Path::new(key)).map_err(|why| TlsError::Key { path: key.to_string(), why })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(|e| TlsError::Config(describe(&e)))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let data = std::fs::read(path).map_err(|e| e.to_string())?;
    let certs = CertificateDer::pem_slice_iter(&data).collect::<Result<Vec<_>, _>>().map_err(|e| format!("not a PEM certificate chain ({e})"))?;
    if certs.is_empty() {
        return Err("no PEM certificate (-----BEGIN CERTIFICATE-----) in the file".into());
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let data = std::fs::read(path).map_err(|e| e.to_string())?;
    if data.windows(b"ENCRYPTED".len()).any(|w| w == b"ENCRYPTED") {
        return Err("the private key is encrypted; give it without a passphrase".into());
    }
    PrivateKeyDer::from_pem_slice(&data).map_err(|e| format!("no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file ({e})"))
}

fn describe(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InconsistentKeys(_) => "the private key does not belong to the certificate".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    fn pair(names: &[&str]) -> (String, String) {
        let c = rcgen::generate_simple_self_signed(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        (c.signing_key.serialize_pem(), c.cert.pem())
    }

    fn err(key: &str, cert: &str) -> String {
        match acceptor(key, cert) {
            Ok(_) => panic!("{key} and {cert} made a TLS server"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn neither_file_is_plain_http_and_one_alone_is_refused() {
        assert!(acceptor("", "").unwrap().is_none());
        assert!(matches!(acceptor("k.pem", ""), Err(TlsError::Half("--ssl-key-file"))));
        assert!(matches!(acceptor("", "c.pem"), Err(TlsError::Half("--ssl-cert-file"))));
    }

    #[test]
    fn a_matching_pair_serves_and_each_broken_file_is_named() {
        let dir = std::env::temp_dir().join(format!("strata-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (key, cert) = pair(&["localhost"]);
        let (other_key, _) = pair(&["localhost"]);
        let k = write(&dir, "key.pem", &key);
        let c = write(&dir, "cert.pem", &cert);
        assert!(acceptor(&k, &c).unwrap().is_some());

        let missing = dir.join("missing.pem").display().to_string();
        assert!(matches!(acceptor(&missing, &c), Err(TlsError::Key { .. })));
        assert!(matches!(acceptor(&k, &missing), Err(TlsError::Cert { .. })));
        // key and certificate swapped
        let e = err(&c, &k);
        assert!(e.starts_with("--ssl-cert-file"), "{e}");
        let e = err(&write(&dir, "other.pem", &other_key), &c);
        assert!(e.contains("does not belong to the certificate"), "{e}");
        let e = err(&k, &write(&dir, "junk.pem", "hello\n"));
        assert!(e.contains("no PEM certificate"), "{e}");
        let enc = "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let e = err(&write(&dir, "enc.pem", enc), &c);
        assert!(e.contains("encrypted"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
