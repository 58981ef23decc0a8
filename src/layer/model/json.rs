//! The few numbers the layer reads of a model call's JSON — the output bound a request sets,
//! the tokens a reply (or one event of its stream) reports in its `usage` — read as the JSON
//! passes: nothing of the request or the reply is kept but those numbers.

use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The tokens of a response (or event) object's `usage`, or, when it has no `usage` object,
/// of its `response.usage`. Read as the JSON passes: nothing of the object is kept but its
/// counts.
pub(super) fn reply_tokens(json: &[u8]) -> Option<f64> {
    let reply = serde_json::from_slice::<Object<Reply>>(json).ok()?.0?;
    match reply.usage {
        Some(counts) => counts.tokens(),
        None => reply.response?.tokens(),
    }
}

/// The bound a chat request sets on its output: its `max_tokens`, else its
/// `max_completion_tokens`, else its `max_output_tokens` (each only when it is a number).
pub(super) fn output_bound(json: &[u8]) -> Option<f64> {
    let Bounds([max, completion, output]) =
        serde_json::from_slice::<Object<Bounds>>(json).ok()?.0?;
    max.or(completion).or(output)
}

/// A request's output bounds, in the order they are read.
#[derive(Default)]
struct Bounds([Option<f64>; 3]);

/// The keys of a request that bound its output, in the order of their places in [`Bounds`].
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Bound {
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    #[serde(other)]
    Other,
}

impl Place for Bound {
    fn place(self) -> Option<usize> {
        (!matches!(self, Bound::Other)).then_some(self as usize)
    }
}

impl FromMap for Bounds {
    fn read<'de, A: MapAccess<'de>>(&mut self, map: &mut A) -> Result<bool, A::Error> {
        read_number::<Bound, A>(&mut self.0, map)
    }
}

/// A response object as far as its usage goes: its `usage` when that is an object, and its
/// `response`'s `usage` (the Responses API's events).
#[derive(Default)]
struct Reply {
    usage: Option<Counts>,
    response: Option<Counts>,
}

/// A `usage` object's counts (a count that is not a number is none). A key given twice counts
/// as its last value, as in any JSON reader.
#[derive(Default)]
struct Counts([Option<f64>; 5]);

/// The keys of a `usage` object that count, in the order of their places in [`Counts`].
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Count {
    TotalTokens,
    PromptTokens,
    InputTokens,
    CompletionTokens,
    OutputTokens,
    #[serde(other)]
    Other,
}

impl Counts {
    /// `total_tokens`, or the prompt (input) tokens and the completion (output) ones.
    fn tokens(&self) -> Option<f64> {
        let [total, prompt, input, completion, output] = self.0;
        total.or_else(|| Some(prompt.or(input)? + completion.or(output).unwrap_or(0.0)))
    }
}

/// What is read of a JSON object, key by key.
trait FromMap: Default {
    fn read<'de, A: MapAccess<'de>>(&mut self, map: &mut A) -> Result<bool, A::Error>;
}

/// The keys of a response object that lead to its usage.
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Key {
    Usage,
    Response,
    #[serde(other)]
    Other,
}

impl FromMap for Reply {
    fn read<'de, A: MapAccess<'de>>(&mut self, map: &mut A) -> Result<bool, A::Error> {
        match map.next_key::<Key>()? {
            None => return Ok(false),
            Some(Key::Usage) => self.usage = map.next_value::<Object<Counts>>()?.0,
            // A Responses API event: the `usage` of its `response`.
            Some(Key::Response) => {
                let inner = map.next_value::<Object<Reply>>()?.0;
                self.response = inner.and_then(|r| r.usage);
            }
            Some(Key::Other) => {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(true)
    }
}

impl Place for Count {
    fn place(self) -> Option<usize> {
        (!matches!(self, Count::Other)).then_some(self as usize)
    }
}

impl FromMap for Counts {
    fn read<'de, A: MapAccess<'de>>(&mut self, map: &mut A) -> Result<bool, A::Error> {
        read_number::<Count, A>(&mut self.0, map)
    }
}

/// A key naming its number's place among the ones read, or none.
trait Place {
    fn place(self) -> Option<usize>;
}

/// Reads the next entry of `map` into `numbers`, at the place its key names (a value that is
/// not a number reads as none; a key that names no place is skipped); whether there was one.
fn read_number<'de, K, A>(numbers: &mut [Option<f64>], map: &mut A) -> Result<bool, A::Error>
where
    K: serde::Deserialize<'de> + Place,
    A: MapAccess<'de>,
{
    let Some(key) = map.next_key::<K>()? else {
        return Ok(false);
    };
    match key.place() {
        Some(at) => numbers[at] = map.next_value::<serde_json::Value>()?.as_f64(),
        None => {
            map.next_value::<IgnoredAny>()?;
        }
    }
    Ok(true)
}

/// A JSON value read as a `T` when it is an object, and as nothing when it is anything else.
struct Object<T>(Option<T>);

impl<'de, T: FromMap> serde::Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ObjectVisitor(std::marker::PhantomData))
            .map(Object)
    }
}

struct ObjectVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: FromMap> Visitor<'de> for ObjectVisitor<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<T>, A::Error> {
        let mut out = T::default();
        while out.read(&mut map)? {}
        Ok(Some(out))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<T>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Option<T>, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// What a JSON reader that builds the whole object finds: the oracle the reader that
    /// keeps only the counts must agree with.
    fn tokens_of_value(json: &str) -> Option<f64> {
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let u = v
            .get("usage")
            .filter(|u| u.is_object())
            .or_else(|| v.get("response")?.get("usage"))?;
        let n = |k: &str| u.get(k).and_then(serde_json::Value::as_f64);
        n("total_tokens").or_else(|| {
            let input = n("prompt_tokens").or_else(|| n("input_tokens"))?;
            let output = n("completion_tokens").or_else(|| n("output_tokens"));
            Some(input + output.unwrap_or(0.0))
        })
    }

    /// A JSON object of `entries`.
    fn object(entries: Vec<(&'static str, String)>) -> String {
        let kv: Vec<String> = entries
            .iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        format!("{{{}}}", kv.join(","))
    }

    /// JSON text of any kind, objects and arrays nested, keys among the ones usage is found by.
    fn any() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            (0u32..1000).prop_map(|n| n.to_string()),
            (-5.0f64..5.0).prop_map(|x| format!("{x:?}")),
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("\"12\"".to_owned()),
        ];
        let keys = prop::sample::select(vec!["usage", "response", "total_tokens", "id"]);
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                prop::collection::vec((keys.clone(), inner.clone()), 0..4).prop_map(object),
                prop::collection::vec(inner, 0..3).prop_map(|v| format!("[{}]", v.join(","))),
            ]
        })
    }

    /// An object of numbers under `keys` (a key perhaps twice, a value perhaps not a number),
    /// or, now and then, not an object at all.
    fn numbers(keys: Vec<&'static str>) -> impl Strategy<Value = String> {
        let value = prop_oneof![
            4 => (0u32..5000).prop_map(|n| n.to_string()),
            1 => any(),
        ];
        let entries = prop::collection::vec((prop::sample::select(keys), value), 0..5);
        prop_oneof![
            4 => entries.prop_map(object),
            1 => any(),
        ]
    }

    /// A `usage`: its counts, or not an object at all.
    fn usage() -> impl Strategy<Value = String> {
        numbers(vec![
            "total_tokens",
            "prompt_tokens",
            "input_tokens",
            "completion_tokens",
            "output_tokens",
            "cached_tokens",
        ])
    }

    /// A response or event object: its `usage` (the key perhaps written with an escape), its
    /// `response` holding one, and other keys, in any order, any of them perhaps twice.
    fn json() -> impl Strategy<Value = String> {
        let response = prop::collection::vec(
            prop_oneof![
                usage().prop_map(|u| ("usage", u)),
                any().prop_map(|v| ("id", v)),
            ],
            0..3,
        )
        .prop_map(object);
        let entry = prop_oneof![
            usage().prop_map(|u| ("usage", u)),
            usage().prop_map(|u| ("us\\u0061ge", u)),
            response.prop_map(|r| ("response", r)),
            any().prop_map(|v| ("choices", v)),
        ];
        prop::collection::vec(entry, 0..4).prop_map(object)
    }

    /// A request's output bound as a reader that builds the whole request finds it.
    fn output_bound_of_value(json: &str) -> Option<f64> {
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let bound = |k: &str| v.get(k)?.as_f64();
        bound("max_tokens")
            .or_else(|| bound("max_completion_tokens"))
            .or_else(|| bound("max_output_tokens"))
    }

    /// A chat request: its bounds (perhaps twice, perhaps not numbers) among other keys.
    fn request() -> impl Strategy<Value = String> {
        numbers(vec![
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "max_t\\u006fkens",
            "messages",
        ])
    }

    proptest! {
        #[test]
        fn the_output_bound_read_as_the_json_passes_is_the_whole_requests(json in request()) {
            prop_assert_eq!(output_bound(json.as_bytes()), output_bound_of_value(&json), "{}", json);
        }

        #[test]
        fn the_counts_read_as_the_json_passes_are_the_whole_objects(json in json()) {
            prop_assert_eq!(reply_tokens(json.as_bytes()), tokens_of_value(&json), "{}", json);
        }
    }
}
