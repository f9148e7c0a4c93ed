//! HAProxy (Debian's `haproxy`) as a test's proxy: started on a free port of 127.0.0.1
//! in front of a backend of the test's, killed by its process handle.

use std::net::SocketAddr;

#[path = "daemon.rs"]
mod daemon;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// HAProxy in HTTP mode, in the foreground (`-db`), proxying to one server with at most
/// `maxconn` requests at a time; the requests past it wait in HAProxy's queue, first
/// come first served, for up to 30 s (its defaults otherwise: a request whose client has
/// gone is still sent when its turn comes). Killed, and its directory removed, when
/// dropped.
/// Its address is the process's (`addr`).
pub(crate) struct Haproxy(daemon::Daemon);

impl std::ops::Deref for Haproxy {
    type Target = daemon::Daemon;

    fn deref(&self) -> &daemon::Daemon {
        &self.0
    }
}

impl Haproxy {
    /// Starts HAProxy on a free port of 127.0.0.1 in front of `backend`, and waits (at
    /// most 10 s) until it accepts connections. Fails with a clear message if HAProxy is
    /// not installed.
    pub(crate) async fn start(backend: SocketAddr, maxconn: u32) -> Result<Self, BoxError> {
        let daemon = daemon::Daemon::start("haproxy", "haproxy", "stderr", |dir, port| {
            let config = format!(
                "global\n  maxconn 4000\n\
                 defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n  \
                 timeout server 30s\n  timeout queue 30s\n\
                 frontend app\n  bind 127.0.0.1:{port}\n  default_backend app\n\
                 backend app\n  server app {backend} maxconn {maxconn}\n"
            );
            let conf = dir.join("haproxy.cfg");
            std::fs::write(&conf, config)?;
            Ok(vec!["-db".into(), "-f".into(), conf.into_os_string()])
        })
        .await?;
        Ok(Haproxy(daemon))
    }
}
