//! Many streaming clients at once, a share of them hanging up mid-stream: every slot must come
//! back to idle, memory must not keep growing, and the server must keep answering.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{model, Server};

const CLIENTS: usize = 64;

/// One round: CLIENTS streams; every third client hangs up after a few chunks.
fn round(server: &Server, seed: u64) -> usize {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|i| {
                s.spawn(move || {
                    let x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                    let n_predict = 8 + (x % 40) as usize;
                    let hang_up_after = (i % 3 == 0).then_some(1 + (x >> 8) as usize % 4);
                    let req = json!({"prompt": format!("Story number {i}:"), "n_predict": n_predict, "stream": true});
                    let res = ureq::post(&format!("{}/completion", server.base)).timeout(Duration::from_secs(120)).send_json(req).expect("stream request");
                    let mut chunks = 0;
                    for line in BufReader::new(res.into_reader()).lines() {
                        let Ok(line) = line else { break };
                        if line.starts_with("data: ") {
                            chunks += 1;
                            if hang_up_after == Some(chunks) {
                                return 0;
                            }
                        }
                    }
                    chunks
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).filter(|&c| c > 0).count()
    })
}

fn wait_idle(server: &Server) {
    let t0 = Instant::now();
    loop {
        let (_, slots) = server.get("/slots");
        if slots.as_array().unwrap().iter().all(|s| s["is_processing"] == false) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "slots stay busy: {slots}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sixty_four_streams_with_hang_ups_leave_the_server_healthy() {
    let m = model("tiny-llama.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "-c", "4096", "-np", "4"], &[]);
    let finished = round(&server, 1);
    assert!(finished >= CLIENTS / 2, "only {finished} streams finished");
    wait_idle(&server);
    let rss_1 = server.rss_kib();
    for seed in 2..4 {
        round(&server, seed);
        wait_idle(&server);
    }
    let rss_3 = server.rss_kib();
    assert!(rss_3 < rss_1 + rss_1 / 10 + 16 * 1024, "memory grew from {rss_1} KiB to {rss_3} KiB");
    let (status, body) = server.post("/completion", &json!({"prompt": "Still there?", "n_predict": 4}));
    assert_eq!(status, 200, "{body}");
}
