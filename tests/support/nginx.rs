//! nginx (Debian's `nginx-light`) as a test's server: started on a free port of
//! 127.0.0.1 with a configuration of the test's, killed by its process handle.

use std::net::SocketAddr;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The test's lines of nginx's configuration (each may be empty).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Conf<'a> {
    /// In the `http` block.
    pub(crate) http: &'a str,
    /// In the `server` block.
    pub(crate) server: &'a str,
    /// In the `location /` block.
    pub(crate) location: &'a str,
}

/// nginx in front of a backend of the test's, configured by the test (`http`: lines of
/// its `http` block; `server`: of its `server` block; `location`: of its `location /`,
/// which proxies to the backend). Its own process (`master_process off`, `daemon off`)
/// in its own temporary directory, killed by its process handle and its directory
/// removed when dropped, so a failing test still cleans up.
pub(crate) struct Nginx {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub(crate) addr: SocketAddr,
}

impl Nginx {
    /// Starts nginx on a free port of 127.0.0.1 (`http2`: speaking HTTP/2 with prior
    /// knowledge), proxying to `backend` (HTTP/1.1 with upstream keep-alive), and waits
    /// (at most 10 s) until it accepts connections. Fails with a clear message if nginx
    /// is not installed.
    pub(crate) async fn start(
        http2: bool,
        backend: SocketAddr,
        conf: Conf<'_>,
    ) -> Result<Self, BoxError> {
        // Debian installs it in /usr/sbin, which a user's PATH may not hold.
        let binary = if std::path::Path::new("/usr/sbin/nginx").exists() {
            "/usr/sbin/nginx"
        } else {
            "nginx"
        };
        let mut last_error = String::new();
        // A port found free can be taken before nginx binds it: try a few.
        for attempt in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let dir = std::env::temp_dir().join(format!(
                "stormguard-nginx-{}-{port}-{attempt}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir)?;
            let listen = if http2 {
                format!("127.0.0.1:{port} http2")
            } else {
                format!("127.0.0.1:{port}")
            };
            let Conf {
                http,
                server,
                location,
            } = conf;
            let d = dir.display();
            let config = format!(
                "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\n\
                 error_log {d}/error.log warn;\nevents {{ worker_connections 256; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  \
                 proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  \
                 uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  {http}\n  \
                 upstream app {{ server {backend}; keepalive 16; }}\n  \
                 server {{\n    listen {listen};\n    {server}\n    \
                 location / {{\n      proxy_pass http://app;\n      \
                 proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      \
                 {location}\n    }}\n  }}\n}}\n"
            );
            let conf = dir.join("nginx.conf");
            std::fs::write(&conf, config)?;
            let spawned = std::process::Command::new(binary)
                .arg("-p")
                .arg(&dir)
                .arg("-c")
                .arg(&conf)
                .args(["-e", "stderr"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    if e.kind() == std::io::ErrorKind::NotFound {
                        return Err("nginx is not installed: `apt-get install nginx-light` \
                                    (.ci/run does this)"
                            .into());
                    }
                    return Err(format!("cannot start nginx: {e}").into());
                }
            };
            let mut nginx = Nginx {
                child,
                dir,
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
            };
            match nginx.wait_until_ready().await {
                Ok(()) => return Ok(nginx),
                Err(e) => last_error = e.to_string(), // dropped: killed, directory removed
            }
        }
        Err(format!("nginx did not start: {last_error}").into())
    }

    async fn wait_until_ready(&mut self) -> Result<(), BoxError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
                return Err(format!("nginx exited with {status}: {log}").into());
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("nginx accepted no connection on {} within 10 s", self.addr).into())
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
