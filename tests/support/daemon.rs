//! A third-party server a test starts: on a free port of 127.0.0.1, in a temporary
//! directory of its own, killed by its process handle (and its directory removed) when
//! dropped, so a failing test still cleans up.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A running server and where it listens.
pub(crate) struct Daemon {
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// The file in `dir` whose text says why the server exited early.
    log: &'static str,
    pub(crate) addr: SocketAddr,
}

impl Daemon {
    /// Starts `name` (Debian's package `package`; looked for in /usr/sbin first, which a
    /// user's PATH may not hold) on a free port, its standard error in `stderr` of its
    /// directory: `configure(dir, port)` writes its configuration there and returns its
    /// arguments; `log` names the file that explains an early exit. Waits (at most 10 s)
    /// until it accepts connections; a port found free can be taken before the server
    /// binds it, so five are tried. Fails with a clear message if it is not installed.
    pub(crate) async fn start(
        name: &str,
        package: &str,
        log: &'static str,
        configure: impl Fn(&Path, u16) -> std::io::Result<Vec<OsString>>,
    ) -> Result<Self, BoxError> {
        let sbin = Path::new("/usr/sbin").join(name);
        let binary = if sbin.exists() {
            sbin.into_os_string()
        } else {
            OsString::from(name)
        };
        let mut last_error = String::new();
        for attempt in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let dir = std::env::temp_dir().join(format!(
                "stormguard-{name}-{}-{port}-{attempt}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir)?;
            let spawned = configure(&dir, port).and_then(|args| {
                std::process::Command::new(&binary)
                    .args(args)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::fs::File::create(dir.join("stderr"))?)
                    .spawn()
            });
            let child = match spawned {
                Ok(child) => child,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    if e.kind() == std::io::ErrorKind::NotFound {
                        return Err(format!(
                            "{name} is not installed: `apt-get install {package}` \
                             (.ci/run does this)"
                        )
                        .into());
                    }
                    return Err(format!("cannot start {name}: {e}").into());
                }
            };
            let mut daemon = Daemon {
                child,
                dir,
                log,
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
            };
            match daemon.wait_until_ready(name).await {
                Ok(()) => return Ok(daemon),
                Err(e) => last_error = e.to_string(), // dropped: killed, directory removed
            }
        }
        Err(format!("{name} did not start: {last_error}").into())
    }

    async fn wait_until_ready(&mut self, name: &str) -> Result<(), BoxError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(self.dir.join(self.log)).unwrap_or_default();
                return Err(format!("{name} exited with {status}: {log}").into());
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("{name} accepted no connection on {} within 10 s", self.addr).into())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
