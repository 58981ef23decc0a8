//! Redis servers the tests start themselves: on free loopback ports, with persistence off and
//! a temporary directory, killed (and the directory removed) when the guard drops. Never the
//! machine's own Redis.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const REDIS_SERVER: &str = "/usr/bin/redis-server";
pub const REDIS_CLI: &str = "/usr/bin/redis-cli";

pub mod tls;

pub(crate) static SEQ: AtomicU32 = AtomicU32::new(0);

/// A free loopback port (and, for a cluster node, its bus port +10000 free too).
pub fn free_port(with_bus: bool) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = l.local_addr().unwrap().port();
        if port > 55000 && with_bus {
            continue;
        }
        if with_bus && TcpListener::bind(("127.0.0.1", port + 10000)).is_err() {
            continue;
        }
        return port;
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "fairshare-redis-{}-{}-{}",
        std::process::id(),
        tag,
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// One redis-server child process.
pub struct RedisServer {
    pub port: u16,
    child: Mutex<Option<Child>>,
    dir: PathBuf,
    cluster: bool,
}

impl RedisServer {
    /// Starts a standalone server on a free loopback port.
    pub fn start() -> RedisServer {
        Self::start_with(false)
    }

    fn start_with(cluster: bool) -> RedisServer {
        for _ in 0..5 {
            let port = free_port(cluster);
            let dir = temp_dir(if cluster { "cluster" } else { "single" });
            let s = RedisServer {
                port,
                child: Mutex::new(None),
                dir,
                cluster,
            };
            if s.spawn() {
                return s;
            }
        }
        panic!("could not start redis-server");
    }

    /// Starts the process on `self.port` (again, after `kill`). True when it answers PING.
    pub fn spawn(&self) -> bool {
        let mut cmd = Command::new(REDIS_SERVER);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "yes", "--loglevel", "warning"])
            .args(["--enable-debug-command", "local"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]);
        }
        let child = cmd.spawn().expect("spawn /usr/bin/redis-server");
        *self.child.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.ping() {
                return true;
            }
            if let Some(c) = self.child.lock().unwrap().as_mut() {
                if let Ok(Some(_)) = c.try_wait() {
                    return false;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn ping(&self) -> bool {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// A blocking connection to this server.
    pub fn conn(&self) -> redis::Connection {
        let c = redis::Client::open(self.url()).unwrap();
        let conn = c
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect to the test redis");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn
    }

    /// Deletes everything: only ever on a server this test started.
    pub fn flushall(&self) {
        let _: () = redis::cmd("FLUSHALL").query(&mut self.conn()).unwrap();
    }

    pub fn dbsize(&self) -> usize {
        redis::cmd("DBSIZE").query(&mut self.conn()).unwrap()
    }

    /// Keys holding callers' state: all but the stores' epoch markers (one per tool, kept for
    /// good: they tell a store when Redis lost its state).
    pub fn state_keys(&self) -> usize {
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query(&mut self.conn()).unwrap();
        keys.iter().filter(|k| k.last() != Some(&b'@')).count()
    }

    /// Keys holding callers' state under `namespace` (a prefix of every key), markers aside.
    pub fn state_keys_in(&self, namespace: &str) -> usize {
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg(format!("{namespace}*"))
            .query(&mut self.conn())
            .unwrap();
        keys.iter().filter(|k| k.last() != Some(&b'@')).count()
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-master Redis Cluster on loopback.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_with(true)).collect();
        let mut cmd = Command::new(REDIS_CLI);
        cmd.arg("--cluster").arg("create");
        for n in &nodes {
            cmd.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = cmd
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = nodes.iter().all(|n| {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut n.conn())
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
            });
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "cluster never became ok");
            std::thread::sleep(Duration::from_millis(100));
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// Total keys over every master.
    pub fn dbsize(&self) -> usize {
        self.nodes.iter().map(|n| n.dbsize()).sum()
    }

    /// Keys holding callers' state over every master (see [`RedisServer::state_keys`]).
    pub fn state_keys(&self) -> usize {
        self.nodes.iter().map(|n| n.state_keys()).sum()
    }

    /// Keys holding callers' state under `namespace` over every master.
    pub fn state_keys_in(&self, namespace: &str) -> usize {
        self.nodes.iter().map(|n| n.state_keys_in(namespace)).sum()
    }

    pub fn flushall(&self) {
        for n in &self.nodes {
            n.flushall();
        }
    }
}

/// Calls of one command so far, from `INFO commandstats` (e.g. "evalsha").
pub fn command_calls(conn: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    let needle = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
