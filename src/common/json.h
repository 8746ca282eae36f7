// JSON read from outside gpusnap (agent requests, handshake messages, manifests) is parsed
// here, bounded in depth before nlohmann-json sees it. The library's parser keeps its own
// stack, but dump() and the destructor of a parsed value recurse once per level: a body of
// 80000 '[' (160 KB) overflowed the agent's stack when an error message dumped it.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace gpusnap::json_text {

// Deeper than anything gpusnap writes (a manifest nests 4 levels) by far, and shallow enough
// that every recursive walk of a value stays a few KiB of stack.
inline constexpr int kMaxDepth = 64;

// The deepest nesting of arrays and objects in `text`, counted without recursion and without
// looking into strings; stops counting at `limit + 1`.
int nesting_depth(std::string_view text, int limit = kMaxDepth);

// Parses untrusted text. Returns nullopt and sets *why (one line: "nested deeper than 64
// levels", or the parser's own complaint) when the text is not JSON or nests too deep. Never
// throws.
std::optional<nlohmann::json> parse(std::string_view text, std::string* why = nullptr);

// A value for an error message, as JSON (a string in quotes): compact, invalid UTF-8
// replaced, cut to `max_chars`.
std::string brief(const nlohmann::json& value, size_t max_chars = 80);

}  // namespace gpusnap::json_text
