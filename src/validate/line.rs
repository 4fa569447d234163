//! What one JSONL line says about the fields the rules look at, read in one parse.
//!
//! The line is parsed completely (so invalid JSON anywhere is caught) but only the
//! fields the rules need are kept; everything else, the bulk of `body` included, is
//! skipped without being built. A key repeated in the line or in its `body` makes the
//! line invalid: which of the two values counts is a guess, and executing the line would
//! have to guess again (the record then could not be matched to the line).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A top-level field that the rules want to be a string.
#[derive(Debug, Default, PartialEq, Eq)]
pub enum Text<'a> {
    #[default]
    Missing,
    NotString,
    Value(Cow<'a, str>),
}

#[derive(Debug, Default, PartialEq, Eq)]
pub enum Body<'a> {
    #[default]
    Missing,
    NotObject,
    Object {
        keys: usize,
        stream_true: bool,
        /// `body.model`, for the Batch's `model`.
        model: Text<'a>,
        /// Whether `body.input` and `body.prompt` are there (and not null).
        input: bool,
        prompt: bool,
        /// The first key the body repeats.
        repeated: Option<String>,
    },
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct LineFacts<'a> {
    pub custom_id: Text<'a>,
    pub method: Text<'a>,
    pub url: Text<'a>,
    pub body: Body<'a>,
}

/// Why a line is not even a JSON object whose keys each appear once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    NotJson,
    NotObject,
    /// A key appears twice: its path (`custom_id`, `body.model`).
    RepeatedKey(String),
}

impl<'a> LineFacts<'a> {
    pub fn read(line: &'a [u8]) -> Result<Self, Shape> {
        let text = std::str::from_utf8(line).map_err(|_| Shape::NotJson)?;
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let facts = deserializer.deserialize_any(LineVisitor).map_err(|_| Shape::NotJson)?;
        deserializer.end().map_err(|_| Shape::NotJson)?;
        let (facts, repeated) = facts.ok_or(Shape::NotObject)?;
        let repeated = repeated.or_else(|| match &facts.body {
            Body::Object { repeated: Some(key), .. } => Some(format!("body.{key}")),
            _ => None,
        });
        match repeated {
            Some(path) => Err(Shape::RepeatedKey(path)),
            None => Ok(facts),
        }
    }
}

/// The keys of one object seen so far: a short list while it is short, a set after, so
/// that a line of a million keys costs no more than linear time.
#[derive(Default)]
struct SeenKeys<'a> {
    few: Vec<Cow<'a, str>>,
    many: std::collections::HashSet<Cow<'a, str>>,
}

impl<'a> SeenKeys<'a> {
    const FEW: usize = 16;

    /// Adds `key`; false when it was there already.
    fn insert(&mut self, key: Cow<'a, str>) -> bool {
        if self.few.contains(&key) {
            return false;
        }
        if self.few.len() < Self::FEW {
            self.few.push(key);
            return true;
        }
        self.many.insert(key)
    }
}

/// Implements every `visit_*` of a visitor that accepts any JSON value: scalars
/// become `$other`, arrays and objects are skipped whole and become `$other` too,
/// unless the visitor defines its own `visit_map`.
macro_rules! accept_any_value {
    ($other:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
}

struct LineVisitor;

impl<'de> Visitor<'de> for LineVisitor {
    /// The facts, with the first top-level key repeated; `None` if not an object.
    type Value = Option<(LineFacts<'de>, Option<String>)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    accept_any_value!(None);

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut facts = LineFacts::default();
        let (mut seen, mut repeated) = (SeenKeys::default(), None);
        while let Some(key) = map.next_key::<Key<'de>>()? {
            if !seen.insert(key.0.clone()) && repeated.is_none() {
                repeated = Some(key.0.clone().into_owned());
            }
            match key.0.as_ref() {
                "custom_id" => facts.custom_id = map.next_value::<TextSeed<'de>>()?.0,
                "method" => facts.method = map.next_value::<TextSeed<'de>>()?.0,
                "url" => facts.url = map.next_value::<TextSeed<'de>>()?.0,
                "body" => facts.body = map.next_value::<BodySeed<'de>>()?.0,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some((facts, repeated)))
    }
}

/// An object key, borrowed from the line unless it held escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(TextVisitor).and_then(|text| match text {
            Text::Value(text) => Ok(Key(text)),
            _ => Err(de::Error::custom("object keys are strings")),
        })
    }
}

struct TextSeed<'a>(Text<'a>);

impl<'de> serde::Deserialize<'de> for TextSeed<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TextVisitor).map(TextSeed)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    accept_any_value!(Text::NotString);

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
        Ok(Text::Value(Cow::Borrowed(text)))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(Text::Value(Cow::Owned(text.to_owned())))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Text::NotString)
    }
}

struct BodySeed<'a>(Body<'a>);

impl<'de> serde::Deserialize<'de> for BodySeed<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(BodyVisitor).map(BodySeed)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    accept_any_value!(Body::NotObject);

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Body::NotObject)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut keys, mut stream_true, mut model, mut input, mut prompt) = (0, false, Text::Missing, false, false);
        let (mut seen, mut repeated) = (SeenKeys::default(), None);
        while let Some(key) = map.next_key::<Key<'de>>()? {
            keys += 1;
            if !seen.insert(key.0.clone()) && repeated.is_none() {
                repeated = Some(key.0.clone().into_owned());
            }
            match key.0.as_ref() {
                "stream" => stream_true = map.next_value::<Literal>()? == Literal::True,
                "model" => model = map.next_value::<TextSeed<'de>>()?.0,
                "input" => input = map.next_value::<Literal>()? != Literal::Null,
                "prompt" => prompt = map.next_value::<Literal>()? != Literal::Null,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Body::Object { keys, stream_true, model, input, prompt, repeated })
    }
}

/// Which of the literals `true` and `null` a value is, if either (`stream: "true"` is
/// neither); anything else is skipped without being built.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Literal {
    True,
    Null,
    Other,
}

impl<'de> serde::Deserialize<'de> for Literal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(LiteralVisitor)
    }
}

struct LiteralVisitor;

impl<'de> Visitor<'de> for LiteralVisitor {
    type Value = Literal;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        Ok(if value { Literal::True } else { Literal::Other })
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Literal::Other)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Literal::Other)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Literal::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Literal::Null)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Literal::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Literal::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Literal::Other)
    }
}
