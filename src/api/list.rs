//! OpenAI's cursor-paged list shape, shared by files and batches.

use serde::Serialize;

#[derive(Serialize)]
pub struct ListPage<T> {
    pub object: &'static str,
    pub data: Vec<T>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

impl<T> ListPage<T> {
    pub fn new(data: Vec<T>, has_more: bool, id_of: impl Fn(&T) -> String) -> Self {
        Self { object: "list", first_id: data.first().map(&id_of), last_id: data.last().map(&id_of), data, has_more }
    }
}
