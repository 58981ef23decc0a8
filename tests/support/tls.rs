//! TLS for the tests' own Redis servers: a certificate authority, a server certificate for
//! 127.0.0.1 and a client certificate it signs, and an unrelated authority, all made here
//! with the `openssl` command in a temporary directory; and redis-server processes (one, or a
//! 3-master Cluster) that speak only TLS, on free loopback ports.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, REDIS_CLI, REDIS_SERVER};

/// Certificates made for one test, removed with it.
pub struct Certs {
    pub dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (install it: the TLS tests make their certificates with it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Certs {
    /// A CA (`ca.crt`), a server certificate for 127.0.0.1 / localhost (`server.crt`,
    /// `server.key`) and a client certificate (`client.crt`, `client.key`) it signed, and
    /// another CA (`other-ca.crt`) that signed neither.
    pub fn make() -> Certs {
        let dir = std::env::temp_dir().join(format!(
            "fairshare-tls-{}-{}",
            std::process::id(),
            super::SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.crt"),
                    "-subj",
                    &format!("/CN=fairshare test {ca}"),
                ],
            );
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for who in ["server", "client"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                    "-subj",
                    &format!("/CN=fairshare test {who}"),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &format!("{who}.crt"),
                    "-extfile",
                    &format!("{who}.ext"),
                ],
            );
        }
        Certs { dir }
    }

    pub fn pem(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A redis-server that speaks only TLS (no plain port), killed when dropped.
pub struct TlsServer {
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl TlsServer {
    /// On a free loopback port; `auth_clients`: whether clients must present a certificate;
    /// `extra`: more redis-server arguments.
    pub fn start(certs: &Certs, auth_clients: bool, extra: &[&str]) -> TlsServer {
        Self::start_node(certs, auth_clients, extra, false)
    }

    fn start_node(certs: &Certs, auth_clients: bool, extra: &[&str], cluster: bool) -> TlsServer {
        for _ in 0..5 {
            let port = free_port(cluster);
            let dir = certs.dir.join(format!("node-{port}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut cmd = Command::new(REDIS_SERVER);
            cmd.args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--loglevel", "warning"])
                .args(["--tls-cert-file", &certs.path("server.crt")])
                .args(["--tls-key-file", &certs.path("server.key")])
                .args(["--tls-ca-cert-file", &certs.path("ca.crt")])
                .args([
                    "--tls-auth-clients",
                    if auth_clients { "yes" } else { "no" },
                ])
                .arg("--dir")
                .arg(&dir)
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if cluster {
                cmd.args(["--tls-cluster", "yes", "--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", "2000"]);
            }
            let child = cmd.spawn().expect("spawn /usr/bin/redis-server");
            let mut s = TlsServer { port, child, dir };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if s.cli(certs, &["PING"]).trim() == "PONG" {
                    return s;
                }
                if let Ok(Some(_)) = s.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = s.child.kill();
        }
        panic!("could not start a TLS redis-server");
    }

    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// `redis-cli` over TLS with the test CA and the client certificate; its output.
    pub fn cli(&self, certs: &Certs, args: &[&str]) -> String {
        let out = Command::new(REDIS_CLI)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "--tls"])
            .args(["--cacert", &certs.path("ca.crt")])
            .args([
                "--cert",
                &certs.path("client.crt"),
                "--key",
                &certs.path("client.key"),
            ])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-master Redis Cluster whose nodes (and their bus) speak only TLS.
pub struct TlsCluster {
    pub nodes: Vec<TlsServer>,
}

impl TlsCluster {
    pub fn start(certs: &Certs) -> TlsCluster {
        let nodes: Vec<TlsServer> = (0..3)
            .map(|_| TlsServer::start_node(certs, false, &[], true))
            .collect();
        let mut cmd = Command::new(REDIS_CLI);
        cmd.args(["--tls", "--cacert", &certs.path("ca.crt")])
            .args([
                "--cert",
                &certs.path("client.crt"),
                "--key",
                &certs.path("client.key"),
            ])
            .args(["--cluster", "create"]);
        for n in &nodes {
            cmd.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = cmd
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "TLS cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !nodes.iter().all(|n| {
            n.cli(certs, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        }) {
            assert!(Instant::now() < deadline, "TLS cluster never became ok");
            std::thread::sleep(Duration::from_millis(100));
        }
        TlsCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }
}
