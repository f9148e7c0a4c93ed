//! nginx (Debian's `nginx-light`) as a test's server: started on a free port of
//! 127.0.0.1 with a configuration of the test's, killed by its process handle.

use std::net::SocketAddr;

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

#[path = "daemon.rs"]
mod daemon;

/// nginx in front of a backend of the test's, configured by the test (`http`: lines of
/// its `http` block; `server`: of its `server` block; `location`: of its `location /`,
/// which proxies to the backend). Its own process (`master_process off`, `daemon off`)
/// in its own temporary directory, killed by its process handle and its directory
/// removed when dropped, so a failing test still cleans up.
/// Its address is the process's (`addr`).
pub(crate) struct Nginx(daemon::Daemon);

impl std::ops::Deref for Nginx {
    type Target = daemon::Daemon;

    fn deref(&self) -> &daemon::Daemon {
        &self.0
    }
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
        let Conf {
            http,
            server,
            location,
        } = conf;
        let daemon = daemon::Daemon::start("nginx", "nginx-light", "error.log", |dir, port| {
            let listen = if http2 {
                format!("127.0.0.1:{port} http2")
            } else {
                format!("127.0.0.1:{port}")
            };
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
            let file = dir.join("nginx.conf");
            std::fs::write(&file, config)?;
            Ok(vec![
                "-p".into(),
                dir.as_os_str().to_owned(),
                "-c".into(),
                file.into_os_string(),
                "-e".into(),
                "stderr".into(),
            ])
        })
        .await?;
        Ok(Nginx(daemon))
    }
}
