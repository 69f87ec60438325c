//! Job payloads as Resque clients write them: `{"class":"X","args":[...]}` plus whatever other
//! keys a producer adds (node-resque's `queue`, php-resque's `id`, ...).
//!
//! The popped bytes are kept exactly; they are what goes back to a queue on requeue and what is
//! embedded in `worker:<id>` and failure records (resque-protocol.md §2, §13 items 3 and 10).
//! Decoding reads only `class` and `args`.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

/// A decoded job: the exact payload text plus the two fields a worker reads.
#[derive(Debug, Clone)]
pub struct Job {
    /// The payload exactly as popped from the queue.
    pub raw: String,
    /// The queue it was reserved from.
    pub queue: String,
    /// The `class` field.
    pub class: String,
    /// The `args` field, decoded with exact number text (`[]` when absent, as Ruby reads it).
    pub args: Value,
    /// The `args` field's exact text (`[]` when absent).
    pub args_raw: String,
}

/// Why a payload cannot be run (locking-semantics.md E-1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// Larger than the configured limit.
    #[error("payload is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Not valid UTF-8 JSON.
    #[error("payload is not valid JSON: {0}")]
    NotJson(String),
    /// Valid JSON, but not an object.
    #[error("payload is not a JSON object")]
    NotObject,
    /// No `class`, or a `class` that is not a non-empty string.
    #[error("payload has no class (a non-empty string is required)")]
    NoClass,
    /// `args` present but not an array.
    #[error("payload args is not an array")]
    ArgsNotArray,
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    class: Option<&'a RawValue>,
    #[serde(borrow, default)]
    args: Option<&'a RawValue>,
}

impl Job {
    /// Decodes a popped payload. `max_bytes` of 0 means no limit.
    pub fn decode(raw: &[u8], queue: &str, max_bytes: usize) -> Result<Job, PayloadError> {
        if max_bytes > 0 && raw.len() > max_bytes {
            return Err(PayloadError::TooLarge {
                size: raw.len(),
                limit: max_bytes,
            });
        }
        let text = std::str::from_utf8(raw).map_err(|e| PayloadError::NotJson(e.to_string()))?;
        // One parse: serde_json validates the whole document while filling `Wire`, but a struct
        // would also accept a JSON array positionally, so objects are told apart first.
        let wire: Wire<'_> = match serde_json::from_str(text) {
            Ok(w) if text.trim_start().starts_with('{') => w,
            Ok(_) => return Err(PayloadError::NotObject),
            Err(e) => {
                return match serde_json::from_str::<Value>(text) {
                    // Only a repeated `class` or `args` fails `Wire` on a valid object: the
                    // last one wins, as in Ruby's JSON.parse, so Resque would run it too.
                    Ok(Value::Object(map)) => Self::from_object(text, queue, map),
                    Ok(_) => Err(PayloadError::NotObject),
                    Err(_) => Err(PayloadError::NotJson(e.to_string())),
                };
            }
        };
        let class = match wire.class.map(|c| serde_json::from_str::<Value>(c.get())) {
            Some(Ok(Value::String(s))) if !s.is_empty() => s,
            _ => return Err(PayloadError::NoClass),
        };
        let (args, args_raw) = match wire.args {
            None => (Value::Array(Vec::new()), "[]".to_string()),
            Some(raw_args) => {
                let v: Value = serde_json::from_str(raw_args.get())
                    .map_err(|e| PayloadError::NotJson(e.to_string()))?;
                if v.is_null() {
                    (Value::Array(Vec::new()), "[]".to_string())
                } else if v.is_array() {
                    (v, raw_args.get().to_string())
                } else {
                    return Err(PayloadError::ArgsNotArray);
                }
            }
        };
        Ok(Job {
            raw: text.to_string(),
            queue: queue.to_string(),
            class,
            args,
            args_raw,
        })
    }

    /// The job of an object parsed whole (the rare path: repeated members).
    fn from_object(
        text: &str,
        queue: &str,
        mut map: serde_json::Map<String, Value>,
    ) -> Result<Job, PayloadError> {
        let class = match map.remove("class") {
            Some(Value::String(s)) if !s.is_empty() => s,
            _ => return Err(PayloadError::NoClass),
        };
        let args = match map.remove("args") {
            None | Some(Value::Null) => Value::Array(Vec::new()),
            Some(v @ Value::Array(_)) => v,
            Some(_) => return Err(PayloadError::ArgsNotArray),
        };
        Ok(Job {
            raw: text.to_string(),
            queue: queue.to_string(),
            class,
            args_raw: args.to_string(),
            args,
        })
    }
}

/// The payload as a JSON object to embed verbatim, if it is one. Anything else, invalid JSON
/// or JSON that is not an object (`[1,2]`, `42`), gives `None`: resque-web reads
/// `payload['class']`, which raises on an array or a number (one such record breaks the whole
/// Failed page) but shows a null as `nil`.
pub fn raw_json(raw: &str) -> Option<Box<RawValue>> {
    let text = raw.trim();
    if !text.starts_with('{') {
        return None;
    }
    RawValue::from_string(text.to_string()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    // resque-protocol.md §13 item 2: payloads of every client decode.
    #[test]
    fn payloads_of_every_client_decode() {
        let cases = [
            r#"{"class":"Archive","args":[44,"masterbrew"]}"#,
            r#"{"class":"jobName","queue":"q","args":[1]}"#,
            r#"{"class":"My_Job","args":[{"a":1}],"id":"abc","prefix":"","queue_time":1700000000.123}"#,
            r#"{"class": "module.Class", "args": [1, 2]}"#,
            r#"{"class":"ActiveJob::QueueAdapters::ResqueAdapter::JobWrapper","args":[{"job_class":"HelloJob"}]}"#,
            r#"{"class":"NoArgs"}"#,
        ];
        for c in cases {
            let job = Job::decode(c.as_bytes(), "q", 0).unwrap();
            assert_eq!(job.raw, c);
            assert!(job.args.is_array());
        }
    }

    // A repeated member is legal JSON; Ruby's JSON.parse keeps the last one and Resque runs
    // the job, so locketd does too (it used to say "not a JSON object").
    #[test]
    fn a_repeated_member_takes_its_last_value() {
        let job = Job::decode(
            br#"{"class":"Dup","args":[1],"class":"Dup2","args":[2,3]}"#,
            "q",
            0,
        )
        .unwrap();
        assert_eq!(
            (job.class.as_str(), job.args_raw.as_str()),
            ("Dup2", "[2,3]")
        );
        assert_eq!(
            Job::decode(br#"{"class":"A","class":7}"#, "q", 0).unwrap_err(),
            PayloadError::NoClass
        );
    }

    #[test]
    fn number_text_is_kept() {
        let job = Job::decode(
            br#"{"class":"A","args":[12345678901234567890123, 1.0]}"#,
            "q",
            0,
        )
        .unwrap();
        assert_eq!(job.args_raw, "[12345678901234567890123, 1.0]");
        assert_eq!(job.args.to_string(), "[12345678901234567890123,1.0]");
    }

    // locking-semantics.md E-1
    #[test]
    fn bad_payloads_are_refused_with_a_reason() {
        assert!(matches!(
            Job::decode(b"{not json", "q", 0),
            Err(PayloadError::NotJson(_))
        ));
        for not_object in [&b"[1,2]"[..], b"[\"A\",[1]]", b"\"A\"", b"42", b"null"] {
            assert_eq!(
                Job::decode(not_object, "q", 0).unwrap_err(),
                PayloadError::NotObject,
                "{}",
                String::from_utf8_lossy(not_object)
            );
        }
        assert!(matches!(
            Job::decode(br#"{"class":"A","args":[]} trailing"#, "q", 0),
            Err(PayloadError::NotJson(_))
        ));
        assert_eq!(
            Job::decode(br#"{"args":[]}"#, "q", 0).unwrap_err(),
            PayloadError::NoClass
        );
        assert_eq!(
            Job::decode(br#"{"class":"","args":[]}"#, "q", 0).unwrap_err(),
            PayloadError::NoClass
        );
        assert_eq!(
            Job::decode(br#"{"class":"A","args":{"a":1}}"#, "q", 0).unwrap_err(),
            PayloadError::ArgsNotArray
        );
        assert!(matches!(
            Job::decode(br#"{"class":"A","args":[]}"#, "q", 10),
            Err(PayloadError::TooLarge {
                size: 23,
                limit: 10
            })
        ));
    }
}
