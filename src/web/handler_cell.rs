//! The handler cell of a worker slot's row (H-8, H-18), in the page's first render; `page.js`
//! builds the same text on refresh.
//!
//! `t pid 42 ready`, as before threads, for a process of one job at a time. When the slot's
//! process runs several jobs at once, the cell adds the thread of the slot's running job and
//! the process's threads busy / total, jobs served and memory:
//! `t pid 42 ready, thread 3 (7/25 busy, 120 jobs, 210.4MiB)`.

use serde_json::Value;

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The cell's text for one of a slot's `handlers` (a [`crate::metrics::HandlerStats`] as JSON).
pub fn handler_cell(h: &Value) -> String {
    let threads = h["threads"].as_u64().unwrap_or(1);
    let state = if h["ready"] != true {
        "not ready"
    } else if threads > 1 && h["retiring"] == true {
        "retiring"
    } else {
        "ready"
    };
    let mut out = format!("{} pid {} {state}", text(&h["name"]), text(&h["pid"]));
    if threads > 1 {
        if let Some(t) = h["thread"].as_u64() {
            out.push_str(&format!(", thread {t}"));
        }
        let memory = h["rss_bytes"]
            .as_u64()
            .map_or("-".into(), |b| format!("{:.1}MiB", b as f64 / 1048576.0));
        out.push_str(&format!(
            " ({}/{threads} busy, {} jobs, {memory})",
            h["threads_busy"].as_u64().unwrap_or(0),
            h["jobs"].as_u64().unwrap_or(0),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_job_per_process_reads_as_before_threads() {
        assert_eq!(
            handler_cell(
                &json!({"name": "ruby", "pid": 7, "ready": true, "threads": 1, "jobs": 3})
            ),
            "ruby pid 7 ready"
        );
        // A report from before threads has none of the fields.
        assert_eq!(
            handler_cell(&json!({"name": "ruby", "pid": null, "ready": false})),
            "ruby pid - not ready"
        );
    }

    // H-18: the slot's job's thread and its process's threads busy / total, jobs, memory.
    #[test]
    fn a_threaded_slot_names_its_thread_and_its_process() {
        let h = json!({"name": "ruby", "pid": 42, "ready": true, "threads": 25,
                       "threads_busy": 7, "thread": 3, "jobs": 120, "rss_bytes": 220_620_000});
        assert_eq!(
            handler_cell(&h),
            "ruby pid 42 ready, thread 3 (7/25 busy, 120 jobs, 210.4MiB)"
        );
        let idle = json!({"name": "ruby", "pid": 42, "ready": true, "threads": 25,
                          "threads_busy": 0, "thread": null, "jobs": 0, "retiring": true});
        assert_eq!(
            handler_cell(&idle),
            "ruby pid 42 retiring (0/25 busy, 0 jobs, -)"
        );
    }
}
