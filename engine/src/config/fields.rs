//! Typed access to the JSON objects of a `config.json`: every error names the dotted field
//! path and what was expected there.

use serde_json::{Map, Value};

use super::error::{field_err, ConfigError, Res};

pub(super) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to one JSON object; errors carry the dotted field path.
pub(super) struct Obj<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) prefix: &'a str,
}

impl<'a> Obj<'a> {
    pub(super) fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    pub(super) fn wrong(&self, key: &str, expected: &str, v: &Value) -> ConfigError {
        field_err(
            self.name(key),
            format!("expected {expected}, got {} ({v})", kind_of(v)),
        )
    }

    /// Missing or null -> `None`; otherwise `conv` must accept the value.
    pub(super) fn opt<T>(
        &self,
        key: &str,
        expected: &str,
        conv: impl Fn(&'a Value) -> Option<T>,
    ) -> Res<Option<T>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| self.wrong(key, expected, v)),
        }
    }

    /// Missing -> `default`; null is a type error (the Python field is not optional).
    pub(super) fn req<T>(
        &self,
        key: &str,
        default: T,
        expected: &str,
        conv: impl Fn(&'a Value) -> Option<T>,
    ) -> Res<T> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => conv(v).ok_or_else(|| self.wrong(key, expected, v)),
        }
    }

    pub(super) fn opt_usize(&self, key: &str) -> Res<Option<usize>> {
        self.opt(key, "a non-negative integer", as_usize)
    }

    pub(super) fn usize_or(&self, key: &str, default: usize) -> Res<usize> {
        self.req(key, default, "a non-negative integer", as_usize)
    }

    pub(super) fn opt_f64(&self, key: &str) -> Res<Option<f64>> {
        self.opt(key, "a number", Value::as_f64)
    }

    pub(super) fn f64_or(&self, key: &str, default: f64) -> Res<f64> {
        self.req(key, default, "a number", Value::as_f64)
    }

    pub(super) fn bool_or(&self, key: &str, default: bool) -> Res<bool> {
        self.req(key, default, "a boolean", Value::as_bool)
    }

    pub(super) fn str_or(&self, key: &str, default: &'static str) -> Res<&'a str> {
        self.req(key, default, "a string", Value::as_str)
    }

    pub(super) fn opt_array(&self, key: &str) -> Res<Option<&'a Vec<Value>>> {
        self.opt(key, "an array", Value::as_array)
    }

    pub(super) fn opt_object(&self, key: &str) -> Res<Option<&'a Map<String, Value>>> {
        self.opt(key, "an object", Value::as_object)
    }
}

pub(super) fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|x| usize::try_from(x).ok())
}
