//! The log lines a test's own thread writes, through a process-wide subscriber.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log lines of `run`, which drives everything on this thread. (A process-wide
/// subscriber that keeps each thread's lines apart: a thread's own default misses events
/// whose call sites another test's thread registered first.)
pub fn logged(run: impl FnOnce()) -> String {
    static LINES: OnceLock<Lines> = OnceLock::new();
    let lines = LINES.get_or_init(|| {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_thread_names(true)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("only this sets one");
        lines
    });
    let me = std::thread::current().name().unwrap_or_default().to_owned();
    let from = lines.0.lock().unwrap().len();
    run();
    let text = String::from_utf8_lossy(&lines.0.lock().unwrap()[from..]).into_owned();
    text.lines()
        .filter(|l| l.contains(&me))
        .map(|l| format!("{l}\n"))
        .collect()
}
