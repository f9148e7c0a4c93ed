//! HAProxy (Debian's `haproxy`) as a test's proxy: started on a free port of 127.0.0.1
//! in front of a backend of the test's, killed by its process handle.

use std::net::SocketAddr;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// HAProxy in HTTP mode, in the foreground (`-db`), proxying to one server with at most
/// `maxconn` requests at a time; the requests past it wait in HAProxy's queue, first
/// come first served, for up to 30 s (its defaults otherwise: a request whose client has
/// gone is still sent when its turn comes). Killed, and its directory removed, when
/// dropped, so a failing test still cleans up.
pub(crate) struct Haproxy {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub(crate) addr: SocketAddr,
}

impl Haproxy {
    /// Starts HAProxy on a free port of 127.0.0.1 in front of `backend`, and waits (at
    /// most 10 s) until it accepts connections. Fails with a clear message if HAProxy is
    /// not installed.
    pub(crate) async fn start(backend: SocketAddr, maxconn: u32) -> Result<Self, BoxError> {
        // Debian installs it in /usr/sbin, which a user's PATH may not hold.
        let binary = if std::path::Path::new("/usr/sbin/haproxy").exists() {
            "/usr/sbin/haproxy"
        } else {
            "haproxy"
        };
        let mut last_error = String::new();
        // A port found free can be taken before HAProxy binds it: try a few.
        for attempt in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let dir = std::env::temp_dir().join(format!(
                "stormguard-haproxy-{}-{port}-{attempt}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir)?;
            let config = format!(
                "global\n  maxconn 4000\n\
                 defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n  \
                 timeout server 30s\n  timeout queue 30s\n\
                 frontend app\n  bind 127.0.0.1:{port}\n  default_backend app\n\
                 backend app\n  server app {backend} maxconn {maxconn}\n"
            );
            let conf = dir.join("haproxy.cfg");
            std::fs::write(&conf, config)?;
            let spawned = std::process::Command::new(binary)
                .arg("-db")
                .arg("-f")
                .arg(&conf)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join("stderr"))?)
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    if e.kind() == std::io::ErrorKind::NotFound {
                        return Err("HAProxy is not installed: `apt-get install haproxy` \
                                    (.ci/run does this)"
                            .into());
                    }
                    return Err(format!("cannot start HAProxy: {e}").into());
                }
            };
            let mut haproxy = Haproxy {
                child,
                dir,
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
            };
            match haproxy.wait_until_ready().await {
                Ok(()) => return Ok(haproxy),
                Err(e) => last_error = e.to_string(), // dropped: killed, directory removed
            }
        }
        Err(format!("HAProxy did not start: {last_error}").into())
    }

    async fn wait_until_ready(&mut self) -> Result<(), BoxError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
                return Err(format!("HAProxy exited with {status}: {log}").into());
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!(
            "HAProxy accepted no connection on {} within 10 s",
            self.addr
        )
        .into())
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
