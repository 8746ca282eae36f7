#include "common/json.h"

namespace gpusnap::json_text {

int nesting_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

std::optional<nlohmann::json> parse(std::string_view text, std::string* why) {
  if (nesting_depth(text) > kMaxDepth) {
    if (why != nullptr) *why = "nested deeper than " + std::to_string(kMaxDepth) + " levels";
    return std::nullopt;
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // The parser's message quotes the last token read, which may be invalid UTF-8: keep the
    // message printable and valid inside a JSON reply.
    if (why != nullptr) {
      *why = nlohmann::json(std::string(e.what()))
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      *why = why->substr(1, why->size() - 2);  // without the quotes of a JSON string
    }
    return std::nullopt;
  }
}

std::string brief(const nlohmann::json& value, size_t max_chars) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > max_chars) {
    // Cut at a character boundary (not inside a UTF-8 sequence).
    size_t cut = max_chars;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut) + "...";
  }
  return text;
}

}  // namespace gpusnap::json_text
