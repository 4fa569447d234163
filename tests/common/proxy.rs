//! A TCP proxy that can cut a process off from a server: once cut, it stops passing
//! bytes both ways and keeps every connection open, as a partition does (requests
//! hang; nothing is refused or reset).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Partition {
    pub addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
}

impl Partition {
    /// Listens on 127.0.0.1 (a port of its own) and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Partition {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let cut = Arc::new(cut);
        let sender = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, target, sender.subscribe()));
            }
        });
        Partition { addr, cut }
    }

    /// From now on, nothing passes, on old connections or new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }
}

async fn forward(mut client: TcpStream, target: SocketAddr, mut cut: watch::Receiver<bool>) {
    let already_cut = *cut.borrow();
    if already_cut {
        return hold_forever(client, None).await;
    }
    let Ok(mut server) = TcpStream::connect(target).await else { return };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = async { drop(cut.wait_for(|cut| *cut).await) } => hold_forever(client, Some(server)).await,
    }
}

async fn hold_forever(client: TcpStream, server: Option<TcpStream>) {
    let _open = (client, server);
    std::future::pending::<()>().await;
}
