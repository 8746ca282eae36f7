// The workload's side of the gpusnap handshake, protocol version 1 (docs/handshake.md is the
// specification). Header-only, C++17, standard library and POSIX only: a workload includes this
// one file and links nothing from gpusnap.
//
//   auto hs = gpusnap::handshake::Client::from_environment();   // GPUSNAP_CONTROL_DIR
//   ... load weights, capture graphs ...
//   hs.ready();
//   hs.serve([&](std::string& reason) { return release_kv_cache(reason); },
//            [&](const gpusnap::handshake::ResumeContext& c, std::string& reason) {
//              return recreate_kv_cache(c, reason);
//            });
//
// Without GPUSNAP_CONTROL_DIR the client is disabled (enabled() == false) and every call is a
// no-op, so the same binary runs with and without gpusnap.
//
// The memory tier (docs/memory-tier.md): a workload that allocates its GPU memory
// with tier_malloc from libgpusnap-tier.so (clients/include/gpusnap/tier_api.h) calls
// hs.use_memory_tier(gpusnap::handshake::MemoryTier::of_library()) once; the client then drains
// that memory into the artifact after on_pause and fills it back at the same addresses before
// on_resume. The library is reached with dlsym, so this header still links nothing of gpusnap
// (glibc before 2.34 needs -ldl for it).
//
// Design constraints, and why:
// - Every message is a file, written "NAME.tmp" then renamed to NAME, and read by path. The
//   client never keeps a descriptor, a cwd or a mapping in the control directory: whatever the
//   workload holds open when it is checkpointed ends up in the snapshot, and at restore each copy
//   gets a different directory mounted at the same path. A descriptor would point at the source's
//   directory (or at nothing).
// - While paused, the client reads only `resume`, which gpusnap writes after the capture: no
//   descriptor into the directory can be open at the moment CRIU freezes the process.
// - The serving thread sleeps with relative sleeps (nanosleep), not with a deadline on the
//   monotonic clock: a restored copy may run on a machine whose monotonic clock is behind the
//   source's, and a deadline computed before the checkpoint would then lie far in the future.
// - The client never calls CUDA: it runs while gpusnap holds the GPU state locked or
//   checkpointed, when any CUDA call would block.
#pragma once

// The version of gpusnap this client belongs to: the top-level CMakeLists.txt's project version,
// which the Python client carries as gpusnap_handshake.__version__ (a static_assert in
// tests/handshake/handshake_client_test.cc and tests/handshake/test_python_package.py keep the
// three equal). A workload built with the client of gpusnap X matches nodes whose
// `gpusnap version` says X.
#define GPUSNAP_CLIENT_VERSION "0.1.0"
#define GPUSNAP_CLIENT_VERSION_MAJOR 0
#define GPUSNAP_CLIENT_VERSION_MINOR 1
#define GPUSNAP_CLIENT_VERSION_PATCH 0

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gpusnap {
namespace handshake {

inline constexpr int kProtocolVersion = 1;
inline constexpr const char* kControlDirVariable = "GPUSNAP_CONTROL_DIR";
// The serving thread polls this often (the protocol asks for every 20-50 ms).
inline constexpr std::chrono::milliseconds kPollInterval{20};

// What gpusnap tells the workload when it resumes it.
struct ResumeContext {
  bool restored = false;  // false: the source itself goes on after a capture (--leave-running)
  int copy = 0;           // this copy's index, 0..copies-1
  int copies = 1;         // how many copies this restore starts
  std::string artifact_id;
  std::map<std::string, std::string> gpu_map;   // old GPU uuid -> new GPU uuid (may be empty)
  std::map<std::string, std::string> settings;  // per-copy settings given at restore
  std::string tier_dir;  // where the memory tier's files are (a copy: in the artifact); may be ""
  // Where gpusnap-tier-prefill offers this copy's memory tier filled ahead; "" if nowhere.
  std::string tier_prefill_dir;
};

// A request the workload has to act on (see Client::poll).
struct Request {
  enum class Kind { kPause, kResume };
  Kind kind = Kind::kPause;
  std::string id;
  long long timeout_ms = 0;  // pause: gpusnap's deadline for the answer; 0 when not given
  ResumeContext context;     // resume only
  std::string tier_dir;      // pause: the folder the memory tier drains into; "" if none
};

// The memory tier's drain and fill, as the client calls them. MemoryTier::of_library() binds
// them to libgpusnap-tier.so; a test may bind its own. Each returns false with `error` set when
// it could not do its work (a drain then released nothing; a fill left nothing mapped).
struct MemoryTier {
  std::function<bool(const std::string& dir, std::string& error)> drain;
  std::function<bool(const std::string& dir, const std::map<std::string, std::string>& gpu_map,
                     std::string& error)>
      fill;
  std::function<bool()> drained;  // whether the last drain has not been filled yet
  // Takes over what a prefill filled ahead in `dir`, before the fill (which then copies only
  // what is left). May be unset: the fill then copies everything.
  std::function<bool(const std::string& dir, std::string& error)> adopt;

  // The tier of libgpusnap-tier.so: the copy already in the process (linked, or loaded by
  // someone else) when `path` is null, else the library at `path`, loaded now and never
  // unloaded. nullopt when there is none.
  static std::optional<MemoryTier> of_library(const char* path = nullptr) {
    // RTLD_DEFAULT is a null pointer: only a dlopen that fails is.
    void* lib = RTLD_DEFAULT;
    if (path != nullptr) {
      lib = ::dlopen(path, RTLD_NOW | RTLD_GLOBAL);
      if (lib == nullptr) return std::nullopt;
    }
    using Drain = int (*)(const char*, char*, size_t);
    using Fill = int (*)(const char*, const char*, char*, size_t);
    using State = int (*)();
    auto drain_fn = reinterpret_cast<Drain>(::dlsym(lib, "gpusnap_tier_drain"));
    auto fill_fn = reinterpret_cast<Fill>(::dlsym(lib, "gpusnap_tier_fill"));
    auto state_fn = reinterpret_cast<State>(::dlsym(lib, "gpusnap_tier_state"));
    if (drain_fn == nullptr || fill_fn == nullptr || state_fn == nullptr) return std::nullopt;
    MemoryTier tier;
    tier.drain = [drain_fn](const std::string& dir, std::string& error) {
      char text[1024] = {};
      if (drain_fn(dir.c_str(), text, sizeof text) == 0) return true;
      error = text;
      return false;
    };
    tier.fill = [fill_fn](const std::string& dir, const std::map<std::string, std::string>& map,
                          std::string& error) {
      std::string pairs;
      for (const auto& [from, to] : map) pairs += (pairs.empty() ? "" : ";") + from + "=" + to;
      char text[1024] = {};
      if (fill_fn(dir.c_str(), pairs.c_str(), text, sizeof text) == 0) return true;
      error = text;
      return false;
    };
    tier.drained = [state_fn] { return state_fn() == 2; };  // GPUSNAP_TIER_DRAINED
    using Adopt = int (*)(const char*, unsigned long long*, char*, size_t);
    if (auto adopt_fn = reinterpret_cast<Adopt>(::dlsym(lib, "gpusnap_tier_adopt"))) {
      tier.adopt = [adopt_fn](const std::string& dir, std::string& error) {
        unsigned long long adopted = 0;
        char text[1024] = {};
        if (adopt_fn(dir.c_str(), &adopted, text, sizeof text) == 0) return true;
        error = text;
        return false;
      };
    }
    return tier;
  }
};

namespace detail {

// ---- A small JSON reader/writer: messages are tiny flat objects (plus "context"). ------------

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  std::string text;         // a string's value, or a number's literal as written
  std::string key;          // the member name when this value is a member of an object
  std::vector<Json> items;  // array elements, or object members in file order

  // The member named k (the last one if repeated, as most JSON readers do), or nullptr.
  const Json* find(const std::string& k) const {
    if (type != Type::kObject) return nullptr;
    const Json* found = nullptr;
    for (const Json& member : items) {
      if (member.key == k) found = &member;
    }
    return found;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}

  // The whole input must be one JSON value (surrounding whitespace allowed).
  bool parse(Json& out) {
    skip_ws();
    if (!value(out, 0)) return false;
    skip_ws();
    return pos_ == s_.size();
  }

 private:
  static constexpr int kMaxDepth = 32;

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool literal(const char* word) {
    const size_t n = std::strlen(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }
  bool value(Json& v, int depth) {
    if (depth > kMaxDepth || pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '{') return object(v, depth);
    if (c == '[') return array(v, depth);
    if (c == '"') {
      v.type = Json::Type::kString;
      return string(v.text);
    }
    if (literal("true")) {
      v.type = Json::Type::kBool;
      v.boolean = true;
      return true;
    }
    if (literal("false")) {
      v.type = Json::Type::kBool;
      v.boolean = false;
      return true;
    }
    if (literal("null")) {
      v.type = Json::Type::kNull;
      return true;
    }
    return number(v);
  }
  bool object(Json& v, int depth) {
    v.type = Json::Type::kObject;
    ++pos_;  // '{'
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return true;
    }
    for (;;) {
      skip_ws();
      Json member;
      if (pos_ >= s_.size() || s_[pos_] != '"' || !string(member.key)) return false;
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') return false;
      ++pos_;
      skip_ws();
      if (!value(member, depth + 1)) return false;
      v.items.push_back(std::move(member));
      skip_ws();
      if (pos_ >= s_.size()) return false;
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] != '}') return false;
      ++pos_;
      return true;
    }
  }
  bool array(Json& v, int depth) {
    v.type = Json::Type::kArray;
    ++pos_;  // '['
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return true;
    }
    for (;;) {
      skip_ws();
      Json item;
      if (!value(item, depth + 1)) return false;
      v.items.push_back(std::move(item));
      skip_ws();
      if (pos_ >= s_.size()) return false;
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] != ']') return false;
      ++pos_;
      return true;
    }
  }
  bool digits() {
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start;
  }
  // The JSON number grammar; the literal is kept as text (see as_int).
  bool number(Json& v) {
    const size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (!digits()) {
      return false;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) return false;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) return false;
    }
    v.type = Json::Type::kNumber;
    v.text = s_.substr(start, pos_ - start);
    return true;
  }
  bool hex4(unsigned& out) {
    if (s_.size() - pos_ < 4) return false;
    out = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      out <<= 4;
      if (c >= '0' && c <= '9')
        out |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        out |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        out |= static_cast<unsigned>(c - 'A' + 10);
      else
        return false;
    }
    return true;
  }
  static void put_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  bool string(std::string& out) {
    ++pos_;  // opening quote
    out.clear();
    while (pos_ < s_.size()) {
      const char c = s_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;  // raw control characters
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) return false;
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = 0;
          if (!hex4(cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            unsigned low = 0;
            if (!literal("\\u") || !hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;  // a lone low surrogate
          }
          put_utf8(out, cp);
          break;
        }
        default: return false;
      }
    }
    return false;  // unterminated
  }

  const std::string& s_;
  size_t pos_ = 0;
};

inline std::optional<Json> parse_json(const std::string& text) {
  Json v;
  if (!JsonParser(text).parse(v)) return std::nullopt;
  return v;
}

// An integer-valued JSON number (no fraction, no exponent) that fits in long long.
inline bool as_int(const Json& v, long long& out) {
  if (v.type != Json::Type::kNumber) return false;
  if (v.text.find_first_of(".eE") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v.text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return false;
  out = n;
  return true;
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not one.
inline size_t utf8_sequence(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  unsigned cp = 0;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF)
    n = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4)
    n = 4, cp = c & 0x07;
  else
    return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;  // overlong, out of range, or a surrogate
  }
  return n;
}

// A JSON string literal. Invalid UTF-8 becomes '?', so that any strict reader (gpusnap's is)
// accepts what the workload wrote, whatever bytes a failure reason carried.
inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else if (c >= 0x80) {
      const size_t n = utf8_sequence(s, i);
      if (n == 0) {
        out += '?';
        ++i;
        continue;
      }
      out.append(s, i, n);
      i += n;
      continue;
    } else {
      out += static_cast<char>(c);
    }
    ++i;
  }
  return out + "\"";
}

// "A short text": reasons are cut at this many bytes (on a UTF-8 boundary).
inline constexpr size_t kMaxReasonBytes = 1000;

inline std::string shorten(std::string reason) {
  if (reason.size() <= kMaxReasonBytes) return reason;
  size_t cut = kMaxReasonBytes;
  while (cut > 0 && (static_cast<unsigned char>(reason[cut]) & 0xC0) == 0x80) --cut;
  reason.resize(cut);
  return reason + "...";
}

// ---- Files ---------------------------------------------------------------------------------

// Messages are small; anything larger than this is not a message of this protocol.
inline constexpr size_t kMaxMessageBytes = 1 << 20;

// The content of DIR/NAME, or nullopt when it is absent or unreadable. Absent is normal: the
// request is not there yet, or the directory itself is gone for a moment (it is swapped at
// restore): the caller just polls again. The descriptor lives only inside this call.
inline std::optional<std::string> read_message(const std::string& dir, const char* name) {
  const std::string path = dir + "/" + name;
  // O_NONBLOCK: a FIFO or a device put there by mistake must not block the poller.
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  std::optional<std::string> out;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
      static_cast<unsigned long long>(st.st_size) <= kMaxMessageBytes) {
    std::string data;
    char buf[4096];
    bool ok = true;
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        ok = false;
        break;
      }
      if (n == 0) break;
      data.append(buf, static_cast<size_t>(n));
      if (data.size() > kMaxMessageBytes) {
        ok = false;
        break;
      }
    }
    if (ok) out = std::move(data);
  }
  ::close(fd);
  return out;
}

// Writes DIR/NAME atomically: DIR/NAME.tmp, then rename. false (and no NAME.tmp left) on any
// error, e.g. while the directory is gone.
inline bool write_message(const std::string& dir, const char* name, const std::string& body) {
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp";
  int fd;
  do {
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return false;
  const std::string data = body + "\n";
  bool ok = true;
  for (size_t done = 0; done < data.size();) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = false;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // Closed before the rename: nothing stays open in the directory.
  if (::close(fd) != 0) ok = false;
  if (ok && ::rename(tmp.c_str(), path.c_str()) == 0) return true;
  ::unlink(tmp.c_str());
  return false;
}

// ---- Requests ------------------------------------------------------------------------------

inline bool string_map(const Json* v, const char* what, std::map<std::string, std::string>& out,
                       std::string& error) {
  if (v == nullptr || v->type == Json::Type::kNull) return true;  // absent: empty
  if (v->type != Json::Type::kObject) {
    error = std::string("context.") + what + " is not an object";
    return false;
  }
  for (const Json& m : v->items) {
    if (m.type != Json::Type::kString) {
      error = std::string("context.") + what + "[" + quote(m.key) + "] is not a string";
      return false;
    }
    out[m.key] = m.text;
  }
  return true;
}

// An optional string member; absent keeps `out` as it is.
inline bool string_field(const Json& obj, const char* name, const char* where, std::string& out,
                         std::string& error) {
  const Json* v = obj.find(name);
  if (v == nullptr) return true;
  if (v->type != Json::Type::kString) {
    error = std::string(where) + name + " is not a string";
    return false;
  }
  out = v->text;
  return true;
}

inline bool int_field(const Json& obj, const char* name, long long lo, long long hi, long long& out,
                      std::string& error) {
  const Json* v = obj.find(name);
  if (v == nullptr) return true;  // absent: keep the default
  long long n = 0;
  if (!as_int(*v, n) || n < lo || n > hi) {
    error = std::string(name) + " is not an integer in range";
    return false;
  }
  out = n;
  return true;
}

// Turns a message into a request. Returns false with `error` set when the message is valid
// JSON with an "id" but a field has the wrong type (the client then answers `failed`). A
// message that is not a JSON object with a string "id" yields false with `id` empty: it cannot
// be answered, so it is ignored.
inline bool parse_request(Request::Kind kind, const std::string& text, Request& req,
                          std::string& error) {
  req = Request{};
  req.kind = kind;
  const auto doc = parse_json(text);
  if (!doc || doc->type != Json::Type::kObject) return false;
  const Json* id = doc->find("id");
  if (id == nullptr || id->type != Json::Type::kString || id->text.empty()) return false;
  req.id = id->text;
  if (kind == Request::Kind::kPause) {
    long long t = 0;
    if (!int_field(*doc, "timeout_ms", 0, 1LL << 40, t, error)) return false;
    req.timeout_ms = t;
    return string_field(*doc, "tier_dir", "", req.tier_dir, error);
  }
  const Json* ctx = doc->find("context");
  if (ctx == nullptr || ctx->type != Json::Type::kObject) {
    error = "no context object";
    return false;
  }
  ResumeContext& c = req.context;
  if (const Json* r = ctx->find("restored")) {
    if (r->type != Json::Type::kBool) {
      error = "context.restored is not a bool";
      return false;
    }
    c.restored = r->boolean;
  }
  long long copy = c.copy;
  long long copies = c.copies;
  if (!int_field(*ctx, "copy", -(1LL << 31), (1LL << 31) - 1, copy, error) ||
      !int_field(*ctx, "copies", -(1LL << 31), (1LL << 31) - 1, copies, error)) {
    error = "context." + error;
    return false;
  }
  c.copy = static_cast<int>(copy);
  c.copies = static_cast<int>(copies);
  if (const Json* a = ctx->find("artifact_id")) {
    if (a->type != Json::Type::kString) {
      error = "context.artifact_id is not a string";
      return false;
    }
    c.artifact_id = a->text;
  }
  return string_map(ctx->find("gpu_map"), "gpu_map", c.gpu_map, error) &&
         string_map(ctx->find("settings"), "settings", c.settings, error) &&
         string_field(*ctx, "tier_dir", "context.", c.tier_dir, error) &&
         string_field(*ctx, "tier_prefill_dir", "context.", c.tier_prefill_dir, error);
}

// Fills a drained tier for a resume: first takes over what a prefill filled ahead (a failure
// there is said on stderr, and the fill copies everything), then fills what is left. False with
// `reason` set when the fill failed.
inline bool fill_tier(MemoryTier& tier, const ResumeContext& context, std::string& reason) {
  if (tier.adopt && !context.tier_prefill_dir.empty()) {
    std::string why;
    if (!tier.adopt(context.tier_prefill_dir, why)) {
      std::fprintf(stderr, "gpusnap handshake: the tier fills by itself: %s\n", why.c_str());
    }
  }
  return tier.fill(context.tier_dir, context.gpu_map, reason);
}

// The client's state. Shared (shared_ptr) between the Client and its serving thread, so that a
// Client can be moved, and stop() may be called from inside a callback.
// Sections of GPU work that a pause waits for and holds back until the resume: the memory tier's
// drain takes the GPU memory away, and a kernel still running, or launched during the pause,
// would touch memory that is no longer there (CUDA_ERROR_ILLEGAL_ADDRESS, the process lost).
// Reentrant per thread (one gate per process: the depth is the thread's, whatever the gate); a
// thread already inside is not waited for.
class Gate {
 public:
  void enter() {
    if (depth()++ > 0) return;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !closed_; });
    ++inside_;
  }
  void leave() {
    if (--depth() > 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    --inside_;
    cv_.notify_all();
  }
  // Holds new sections back and waits for those running; false (and open again) when they did
  // not end within `wait`.
  bool close(std::chrono::milliseconds wait) {
    const int own = depth() > 0 ? 1 : 0;
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    if (cv_.wait_for(lock, wait, [&] { return inside_ <= own; })) return true;
    closed_ = false;
    cv_.notify_all();
    return false;
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = false;
    cv_.notify_all();
  }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int inside_ = 0;
  bool closed_ = false;
};

// How long a pause waits for GPU work sections when the request gives no deadline: half the
// deadline when it does.
inline std::chrono::milliseconds gpu_work_wait(const Request& req) {
  return req.timeout_ms > 0 ? std::chrono::milliseconds(req.timeout_ms / 2)
                            : std::chrono::milliseconds(60000);
}

inline std::string gpu_work_not_ended(std::chrono::milliseconds wait) {
  char text[64];
  std::snprintf(text, sizeof text, "%g", static_cast<double>(wait.count()) / 1000.0);
  return std::string("GPU work in Client::gpu_work() sections did not end within ") + text +
         " s of the pause: finish in-flight requests sooner, or give the pause a longer timeout";
}

struct State {
  std::string dir;  // empty: disabled
  Gate gate;        // GPU work sections (Client::gpu_work)
  std::mutex mu;
  bool paused = false;         // answered `paused`, and no `resumed` since
  bool ready_wanted = false;   // ready() was called
  bool ready_written = false;  // ... and `ready` is written
  // Request ids answered, as "pause:ID" / "resume:ID" (a pause and a resume may share an id).
  // Bounded: only the last few matter (stale requests are those of the last captures).
  std::deque<std::string> answered;
  // The request poll() last handed out and that is not answered yet.
  std::optional<std::pair<Request::Kind, std::string>> outstanding;
  // An answer whose write failed (the directory was gone): rewritten while the same request
  // is still there.
  struct Unsent {
    const char* request;  // "pause" / "resume"
    std::string id;
    const char* name;  // "paused", "resumed", "failed"
    std::string body;
  };
  std::optional<Unsent> unsent;
  std::atomic<bool> stop{false};
  std::optional<MemoryTier> tier;  // set once by use_memory_tier(), before serving

  static constexpr size_t kMaxAnswered = 256;

  static std::string tag(Request::Kind kind, const std::string& id) {
    return (kind == Request::Kind::kPause ? "pause:" : "resume:") + id;
  }
  bool was_answered(Request::Kind kind, const std::string& id) const {
    const std::string t = tag(kind, id);
    for (const auto& a : answered) {
      if (a == t) return true;
    }
    return false;
  }
  void mark_answered(Request::Kind kind, const std::string& id) {
    answered.push_back(tag(kind, id));
    while (answered.size() > kMaxAnswered) answered.pop_front();
    if (outstanding && outstanding->first == kind && outstanding->second == id) {
      outstanding.reset();
    }
  }

  std::string ready_body() const {
    return "{\"protocol\":" + std::to_string(kProtocolVersion) +
           ",\"pid\":" + std::to_string(static_cast<long long>(::getpid())) + "}";
  }
  void write_ready() { ready_written = write_message(dir, "ready", ready_body()); }

  // Writes an answer, marks the request answered whether or not the write worked (the workload
  // did what was asked and must not do it twice), and remembers a failed write for a retry.
  void answer(Request::Kind kind, const std::string& id, const char* name,
              const std::string& body) {
    mark_answered(kind, id);
    const char* request = kind == Request::Kind::kPause ? "pause" : "resume";
    if (write_message(dir, name, body)) {
      unsent.reset();
    } else {
      unsent = Unsent{request, id, name, body};
    }
  }

  // Retries what could not be written before. Not `ready` while paused: nothing but `resume`
  // may be touched then (a capture may be freezing the process).
  void retry_writes() {
    if (ready_wanted && !ready_written && !paused) write_ready();
    if (!unsent) return;
    // Only while gpusnap still waits, i.e. its request is still there.
    Request req;
    std::string error;
    const auto kind =
        std::strcmp(unsent->request, "pause") == 0 ? Request::Kind::kPause : Request::Kind::kResume;
    const auto text = read_message(dir, unsent->request);
    if (!text) return;  // the directory may be gone for a moment: keep the answer
    parse_request(kind, *text, req, error);
    if (req.id != unsent->id) {
      unsent.reset();  // a newer request (or none): the old answer is moot
      return;
    }
    if (write_message(dir, unsent->name, unsent->body)) unsent.reset();
  }

  // The next request to act on; see Client::poll.
  std::optional<Request> poll() {
    std::lock_guard<std::mutex> lock(mu);
    if (dir.empty()) return std::nullopt;
    retry_writes();
    const auto next = [&](Request::Kind kind) -> std::optional<Request> {
      const auto text = read_message(dir, kind == Request::Kind::kPause ? "pause" : "resume");
      if (!text) return std::nullopt;
      Request req;
      std::string error;
      const bool ok = parse_request(kind, *text, req, error);
      if (req.id.empty() || was_answered(kind, req.id)) return std::nullopt;  // ignored
      if (!ok) {
        answer(kind, req.id, "failed",
               "{\"id\":" + quote(req.id) + ",\"reason\":" + quote("bad request: " + error) + "}");
        return std::nullopt;
      }
      return req;
    };
    if (paused) {
      // Only `resume`: see the top of this file.
      auto req = next(Request::Kind::kResume);
      if (req) outstanding = std::make_pair(req->kind, req->id);
      return req;
    }
    if (auto req = next(Request::Kind::kPause)) {
      outstanding = std::make_pair(req->kind, req->id);
      return req;
    }
    // A `resume` that finds the workload running (gpusnap gave up waiting for `paused`, or the
    // pause failed) needs no work: the workload is serving. Answer it so gpusnap is not kept
    // waiting.
    if (auto req = next(Request::Kind::kResume)) {
      answer(req->kind, req->id, "resumed", "{\"id\":" + quote(req->id) + "}");
    }
    return std::nullopt;
  }

  void answer_paused(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    if (dir.empty()) return;
    answer(Request::Kind::kPause, id, "paused", "{\"id\":" + quote(id) + "}");
    paused = true;
  }
  void answer_resumed(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    if (dir.empty()) return;
    // `ready` first: whoever sees `resumed` also sees the workload capturable again, in this
    // directory (a restored copy's directory starts empty).
    if (ready_wanted) write_ready();
    answer(Request::Kind::kResume, id, "resumed", "{\"id\":" + quote(id) + "}");
    paused = false;
    gate.open();
  }
  void answer_failed(const std::string& id, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (dir.empty()) return;
    // Which request is failed: the one poll() handed out, else the one the state expects.
    Request::Kind kind = paused ? Request::Kind::kResume : Request::Kind::kPause;
    if (outstanding && outstanding->second == id) kind = outstanding->first;
    // A failed pause leaves the workload running; a failed resume leaves it paused (gpusnap
    // may send another resume).
    answer(kind, id, "failed",
           "{\"id\":" + quote(id) +
               ",\"reason\":" + quote(shorten(reason.empty() ? "unspecified" : reason)) + "}");
    if (kind == Request::Kind::kPause) gate.open();  // the workload serves on as before
  }

  // poll(), with the gate closed for a pause it hands out; a pause whose GPU work does not end
  // in time is answered failed here and not handed out.
  std::optional<Request> poll_holding_gpu_work() {
    auto req = poll();
    if (!req || req->kind != Request::Kind::kPause) return req;
    const auto wait = gpu_work_wait(*req);
    if (gate.close(wait)) return req;
    answer_failed(req->id, gpu_work_not_ended(wait));
    return std::nullopt;
  }
};

}  // namespace detail

// The workload's handshake client. Two styles:
// - serve(on_pause, on_resume): a background thread polls and calls the callbacks (on that
//   thread), in protocol order, and writes the answers. The callbacks return true for success,
//   or false with `reason` set (an exception counts as false, with what() as the reason).
// - poll() and answer_*(): the caller polls from its own loop (every 20-50 ms) and answers.
// Do not mix the two on one client. One client per control directory: children inherit
// GPUSNAP_CONTROL_DIR, but only the process that coordinates the workload may speak.
class Client {
 public:
  using OnPause = std::function<bool(std::string& reason)>;
  using OnResume = std::function<bool(const ResumeContext&, std::string& reason)>;

  // A client for $GPUSNAP_CONTROL_DIR. Disabled when the variable is unset, empty, or not an
  // absolute path (a relative path would change meaning with the working directory).
  static Client from_environment() {
    const char* dir = std::getenv(kControlDirVariable);
    return Client(dir != nullptr ? std::string(dir) : std::string());
  }

  // A client for an explicit directory (tests; workloads that learn it another way).
  explicit Client(std::string control_dir) : state_(std::make_shared<detail::State>()) {
    while (control_dir.size() > 1 && control_dir.back() == '/') control_dir.pop_back();
    if (!control_dir.empty() && control_dir[0] == '/') state_->dir = std::move(control_dir);
  }

  Client(Client&&) noexcept = default;
  Client& operator=(Client&& other) noexcept {
    if (this != &other) {
      stop();
      state_ = std::move(other.state_);
      thread_ = std::move(other.thread_);
    }
    return *this;
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // RAII: the serving thread must not outlive the client that owns the callbacks' captures.
  ~Client() { stop(); }

  bool enabled() const { return state_ && !state_->dir.empty(); }
  // The control directory; empty when disabled.
  std::string control_dir() const { return state_ ? state_->dir : std::string(); }

  // Announces that the workload is initialised and capturable: writes `ready`. If the
  // directory is not there right now, the write is retried on every poll.
  void ready() {
    if (!enabled()) return;
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->ready_wanted = true;
    state_->write_ready();
  }

  // Makes the client drain `tier` after each pause and fill it before each resume (serve()
  // does both; the polling style calls drain_memory_tier()/fill_memory_tier()). Call it before
  // serve(). A nullopt (no library found) leaves the client as it was.
  void use_memory_tier(std::optional<MemoryTier> tier) {
    if (state_) state_->tier = std::move(tier);
  }

  // At a pause, after the workload released what it does not want saved: drains the tier into
  // the request's tier_dir. True when done or nothing to do; false with `reason` set when the
  // drain failed (nothing was released: undo the pause and answer failed).
  bool drain_memory_tier(const Request& req, std::string& reason) {
    if (!state_ || !state_->tier || req.tier_dir.empty()) return true;
    return state_->tier->drain(req.tier_dir, reason);
  }
  // At a resume, before anything uses GPU memory: fills the tier again. False with `reason` set
  // when the fill failed (nothing stays mapped: answer failed and stay paused).
  bool fill_memory_tier(const Request& req, std::string& reason) {
    if (!state_ || !state_->tier || !state_->tier->drained()) return true;
    return detail::fill_tier(*state_->tier, req.context, reason);
  }

  // A section of GPU work, for as long as the object lives: wrap every section that launches GPU
  // work (a request's forward pass, a generation step) on every thread. A pause waits for the
  // sections running to end and holds new ones back until the workload resumes (a failed pause
  // lets them go at once): nothing runs on the GPU while the memory tier's memory is away. A
  // pause whose sections do not end within half its deadline (60 s without one) fails, saying
  // so. Works, and never blocks, when the client is disabled.
  class GpuWork {
   public:
    explicit GpuWork(std::shared_ptr<detail::State> s) : s_(std::move(s)) {
      if (s_) s_->gate.enter();
    }
    GpuWork(GpuWork&& other) noexcept = default;
    GpuWork& operator=(GpuWork&&) = delete;
    GpuWork(const GpuWork&) = delete;
    GpuWork& operator=(const GpuWork&) = delete;
    ~GpuWork() {
      if (s_) s_->gate.leave();
    }

   private:
    std::shared_ptr<detail::State> s_;
  };
  [[nodiscard]] GpuWork gpu_work() { return GpuWork(state_); }

  // Starts the serving thread and returns at once. No-op when disabled.
  void serve(OnPause on_pause, OnResume on_resume) {
    if (!enabled()) return;
    if (thread_.joinable()) throw std::logic_error("gpusnap handshake: serve() called twice");
    state_->stop = false;
    thread_ =
        std::thread([s = state_, on_pause = std::move(on_pause), on_resume = std::move(on_resume)] {
          while (!s->stop.load()) {
            try {
              serve_once(*s, on_pause, on_resume);
            } catch (...) {
              // Out of memory or the like: keep the thread (and thus the handshake) alive.
            }
            if (s->stop.load()) break;
            // A relative sleep; see the top of this file.
            std::this_thread::sleep_for(kPollInterval);
          }
        });
  }

  // Stops the serving thread (at most one poll interval, plus a callback in progress).
  // From inside a callback it only asks the thread to end after that callback.
  void stop() {
    if (!state_) return;
    state_->stop = true;
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the thread holds its own reference to the state
    } else {
      thread_.join();
    }
  }

  // The next request to act on, or nullopt. While running that is a new `pause`; while paused,
  // a new `resume`. The client itself ignores requests already answered and a `pause` while
  // paused, answers `failed` to malformed requests, and answers `resumed` at once to a `resume`
  // that finds the workload running. The same request is returned until it is answered.
  std::optional<Request> poll() {
    if (!enabled()) return std::nullopt;
    if (thread_.joinable()) throw std::logic_error("gpusnap handshake: poll() while serving");
    return state_->poll_holding_gpu_work();
  }

  // After a pause: in-flight work done, memory released, no more GPU work until resume.
  void answer_paused(const std::string& id) {
    if (enabled()) state_->answer_paused(id);
  }
  // After a resume: memory re-created, settings applied, serving again.
  void answer_resumed(const std::string& id) {
    if (enabled()) state_->answer_resumed(id);
  }
  // The pause or resume `id` could not be done. After a failed pause the workload must be
  // serving as before.
  void answer_failed(const std::string& id, const std::string& reason) {
    if (enabled()) state_->answer_failed(id, reason);
  }

 private:
  static void serve_once(detail::State& s, const OnPause& on_pause, const OnResume& on_resume) {
    // Several requests may be waiting (a pause and then a resume): handle them in order.
    while (!s.stop.load()) {
      const auto req = s.poll_holding_gpu_work();
      if (!req) return;
      std::string reason;
      bool ok = false;
      try {
        if (req->kind == Request::Kind::kPause) {
          ok = on_pause ? on_pause(reason) : true;
          if (ok && s.tier && !req->tier_dir.empty() && !s.tier->drain(req->tier_dir, reason)) {
            // A failed pause leaves the workload as it was: undo on_pause.
            std::string ignored;
            if (on_resume) on_resume(ResumeContext{}, ignored);
            ok = false;
          }
        } else {
          // The memory first: on_resume may use it, and allocates from the tier.
          ok = !s.tier || !s.tier->drained() || detail::fill_tier(*s.tier, req->context, reason);
          if (ok) ok = on_resume ? on_resume(req->context, reason) : true;
        }
      } catch (const std::exception& e) {
        reason = e.what();
      } catch (...) {
        reason = "unknown exception";
      }
      if (!ok) {
        if (reason.empty()) {
          reason = req->kind == Request::Kind::kPause ? "on_pause returned false"
                                                      : "on_resume returned false";
        }
        s.answer_failed(req->id, reason);
      } else if (req->kind == Request::Kind::kPause) {
        s.answer_paused(req->id);
      } else {
        s.answer_resumed(req->id);
      }
    }
  }

  std::shared_ptr<detail::State> state_;
  std::thread thread_;
};

}  // namespace handshake
}  // namespace gpusnap
