#include "cli/agent_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/documents.h"
#include "common/fd.h"
#include "gpusnap/error.h"
#include "gpusnap/phases.h"

namespace gpusnap::cli {

namespace {

using nlohmann::json;

constexpr auto kReplyTimeout = std::chrono::seconds(60);
constexpr auto kPollInterval = std::chrono::milliseconds(100);
// How long a client following an operation waits for an agent that went away (a restart):
// the agent keeps the operation's id across a restart and reports how it ended.
constexpr auto kReconnectFor = std::chrono::seconds(30);

Error unreachable(const std::string& socket, const std::string& what, int err) {
  return Error(ErrorKind::kEnvironment,
               "cannot reach the gpusnap agent at " + socket + ": " + what + ": " +
                   std::error_code(err, std::generic_category()).message(),
               err == EACCES
                   ? "the socket is for root and the agent's --socket-group only"
                   : "start gpusnap-agent, or point --agent / $GPUSNAP_AGENT at its socket");
}

void send_all(int fd, const std::string& data, const std::string& socket) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw unreachable(socket, "send", errno);
    off += static_cast<size_t>(n);
  }
}

std::string read_to_eof(int fd, const std::string& socket) {
  std::string data;
  const auto deadline = std::chrono::steady_clock::now() + kReplyTimeout;
  char buf[16384];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw Error(ErrorKind::kTimeout, "the gpusnap agent at " + socket + " did not answer",
                  "check the agent's log");
    }
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw unreachable(socket, "receive", errno);
    if (n == 0) return data;
    data.append(buf, static_cast<size_t>(n));
  }
}

// The agent's error document as the Error the direct command would have thrown.
Error error_from(const json& e) {
  int code = e.value("exit_code", static_cast<int>(ErrorKind::kInternal));
  if (code < static_cast<int>(ErrorKind::kInternal) || code > static_cast<int>(ErrorKind::kKey)) {
    code = static_cast<int>(ErrorKind::kInternal);
  }
  return Error(static_cast<ErrorKind>(code), e.value("message", "the agent reported an error"),
               e.value("hint", ""));
}

// The body of a reply, as JSON; a non-2xx reply becomes its Error.
json checked(const AgentReply& reply, const std::string& socket) {
  json doc;
  try {
    doc = json::parse(reply.body);
  } catch (const json::exception&) {
    throw Error(ErrorKind::kInternal,
                "the gpusnap agent at " + socket + " answered HTTP " +
                    std::to_string(reply.status) + " with a body that is not JSON",
                "check that --agent names a gpusnap agent");
  }
  if (reply.status >= 200 && reply.status < 300) return doc;
  if (doc.is_object() && doc.contains("error") && doc["error"].is_object()) {
    throw error_from(doc["error"]);
  }
  throw Error(ErrorKind::kInternal,
              "the gpusnap agent at " + socket + " answered HTTP " + std::to_string(reply.status));
}

void refuse_local_flags(const args::Args& args, const std::vector<std::string>& flags) {
  for (const auto& f : flags) {
    if (args.has(f)) {
      throw Error(ErrorKind::kUsage, f + " is not available through the agent",
                  "the agent applies its own setting; drop " + f + " or run without --agent");
    }
  }
}

json checkpoint_request(const args::Args& args) {
  refuse_local_flags(
      args, {"--ghost-limit-mib", "--gpu-lock-timeout", "--no-handshake", "--no-host-images",
             "--no-direct-host-images", "--io-threads", "--host-image-file-mib", "--criu"});
  if (!args.has("--pid")) throw args.usage_error("checkpoint needs --pid PID");
  if (!args.has("--output")) throw args.usage_error("checkpoint needs -o ARTIFACT");
  json body{{"artifact", args.get("--output")},
            {"pid", args.get_int("--pid", 0, 1, 1L << 22)},
            // The API's default is to leave the source running; the CLI's is to stop it.
            {"leave_running", args.has("--leave-running")}};
  if (args.has("--handshake-timeout")) {
    body["handshake_timeout_s"] = args.get_int("--handshake-timeout", 60, 1, 86400);
  }
  return body;
}

json restore_request(const args::Args& args) {
  refuse_local_flags(args, {"--no-verify", "--run-dir", "--timeout", "--criu"});
  json body{{"artifact", args.only_artifact()},
            {"replicas", args.get_int("--replicas", 1, 1, 1024)}};
  if (args.has("--publish")) body["publish"] = args.all("--publish");
  if (args.has("--gpu-map")) {
    json map = json::array();
    for (const auto& m : args.all("--gpu-map")) {
      for (size_t start = 0; start <= m.size();) {  // "a=b,c=d" or the flag repeated
        auto comma = std::min(m.find(',', start), m.size());
        map.push_back(m.substr(start, comma - start));
        start = comma + 1;
      }
    }
    body["gpu_map"] = map;
  }
  if (args.has("--set")) {
    json settings = json::object();
    for (const auto& kv : args.all("--set")) {
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) {
        throw Error(ErrorKind::kUsage, "bad --set '" + kv + "'", "use --set KEY=VALUE");
      }
      settings[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    body["settings"] = settings;
  }
  if (args.has("--handshake-timeout")) {
    body["handshake_timeout_s"] = args.get_int("--handshake-timeout", 60, 1, 86400);
  }
  return body;
}

// Follows an operation until it ends, replaying its phases and notes to `reporter`; returns
// its final document.
json follow(const std::string& socket, const std::string& id, Reporter& reporter) {
  size_t started = 0, finished = 0, notes = 0;
  auto last_contact = std::chrono::steady_clock::now();
  for (;;) {
    json op;
    try {
      op = checked(agent_request(socket, "GET", "/v1/operations/" + id), socket);
      last_contact = std::chrono::steady_clock::now();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kEnvironment ||
          std::chrono::steady_clock::now() - last_contact > kReconnectFor) {
        throw;
      }
      std::this_thread::sleep_for(kPollInterval);
      continue;
    }
    const auto& phases = op.at("phases");
    for (; started < phases.size(); ++started) {
      reporter.phase_started(phases[started].at("name").get<std::string>());
    }
    for (; finished < phases.size() && phases[finished].at("done").get<bool>(); ++finished) {
      reporter.phase_finished(phases[finished].at("name").get<std::string>(),
                              phases[finished].at("seconds").get<double>());
    }
    const auto& lines = op.at("notes");
    for (; notes < lines.size(); ++notes) reporter.note(lines[notes].get<std::string>());
    const auto state = op.at("state").get<std::string>();
    if (state == "succeeded" || state == "failed") return op;
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace

bool AgentChoice::wanted(const std::string& command) const {
  if (socket.empty()) return false;
  for (const char* served : {"checkpoint", "restore", "inspect", "list"}) {
    if (command == served) return true;
  }
  if (from_flag) {
    throw Error(ErrorKind::kUsage, "gpusnap " + command + " does not run through the agent",
                "run it without --agent, on the agent's host");
  }
  return false;
}

AgentChoice take_agent_flag(std::vector<std::string>& argv) {
  AgentChoice choice;
  if (!argv.empty() && argv[0].rfind("--agent=", 0) == 0) {
    choice.socket = argv[0].substr(8);
    argv.erase(argv.begin());
    choice.from_flag = true;
  } else if (!argv.empty() && argv[0] == "--agent") {
    if (argv.size() < 2) {
      throw Error(ErrorKind::kUsage, "--agent needs a SOCKET",
                  std::string("the agent's socket is ") + kDefaultAgentSocket + " by default");
    }
    choice.socket = argv[1];
    argv.erase(argv.begin(), argv.begin() + 2);
    choice.from_flag = true;
  } else if (const char* env = std::getenv(kAgentEnv); env != nullptr) {
    choice.socket = env;
  }
  if (choice.from_flag && choice.socket.empty()) {
    throw Error(ErrorKind::kUsage, "--agent needs a SOCKET",
                std::string("the agent's socket is ") + kDefaultAgentSocket + " by default");
  }
  return choice;
}

AgentReply agent_request(const std::string& socket, const std::string& method,
                         const std::string& target, const std::string& body) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket.size() >= sizeof addr.sun_path) {
    throw Error(ErrorKind::kUsage, "agent socket path " + socket + " is too long",
                "use a path shorter than 108 bytes");
  }
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  common::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw sys_error("socket", errno);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw unreachable(socket, "connect", errno);
  }
  std::string request = method + " " + target +
                        " HTTP/1.1\r\nHost: gpusnap-agent\r\nConnection: close\r\n"
                        "Accept: application/json\r\n";
  if (!body.empty()) {
    request +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  request += "\r\n" + body;
  send_all(fd.get(), request, socket);
  const std::string raw = read_to_eof(fd.get(), socket);

  AgentReply reply;
  const auto head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos || raw.size() < 12) {
    throw Error(ErrorKind::kInternal, "the gpusnap agent at " + socket + " sent no HTTP reply",
                "check that --agent names a gpusnap agent");
  }
  reply.status = static_cast<int>(std::strtol(raw.c_str() + 9, nullptr, 10));
  reply.body = raw.substr(head_end + 4);
  // The agent sends Content-Length; trust it over the connection's end when both are there.
  std::string head = raw.substr(0, head_end);
  for (char& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (auto at = head.find("\r\ncontent-length:"); at != std::string::npos) {
    auto length = static_cast<size_t>(std::strtoull(head.c_str() + at + 17, nullptr, 10));
    if (length < reply.body.size()) reply.body.resize(length);
  }
  return reply;
}

json agent_health(const std::string& socket) {
  return checked(agent_request(socket, "GET", "/v1/healthz"), socket);
}

int run_through_agent(const std::string& socket, const args::Args& args) {
  const bool json_out = args.has("--json");
  const bool quiet = args.has("--quiet");
  const std::string& command = args.command();
  if (command == "list") {
    if (!args.positional().empty()) {
      throw args.usage_error("through the agent, list shows the agent's storage: drop DIR");
    }
    json doc = checked(agent_request(socket, "GET", "/v1/snapshots"), socket);
    if (json_out) {
      std::cout << doc.dump(2) << "\n";
    } else {
      print_list_human(doc);
    }
    return 0;
  }
  if (command == "inspect") {
    const std::string name = args.only_artifact();
    if (name.find('/') != std::string::npos) {
      throw args.usage_error("through the agent, ARTIFACT is a name in the agent's storage, not '" +
                             name + "'");
    }
    json doc = checked(agent_request(socket, "GET", "/v1/snapshots/" + name), socket);
    if (json_out) {
      std::cout << doc.dump(2) << "\n";
    } else {
      print_inspect_human(doc);
    }
    return 0;
  }
  const bool checkpoint = command == "checkpoint";
  json body = checkpoint ? checkpoint_request(args) : restore_request(args);
  json accepted = checked(
      agent_request(socket, "POST", checkpoint ? "/v1/checkpoints" : "/v1/restores", body.dump()),
      socket);
  const auto id = accepted.at("operation").at("id").get<std::string>();

  std::unique_ptr<Reporter> reporter;
  if (json_out || quiet) {
    reporter = std::make_unique<Reporter>();
  } else {
    reporter = std::make_unique<TerminalReporter>(::isatty(STDERR_FILENO) == 1);
  }
  json op = follow(socket, id, *reporter);
  if (op.at("state") == "failed") throw error_from(op.at("error"));
  const json& result = op.at("result");
  if (json_out) {
    std::cout << result.dump(2) << "\n";
  } else if (checkpoint) {
    if (!quiet) print_checkpoint_human(result);
  } else {
    print_restore_human(result, quiet);
  }
  return 0;
}

}  // namespace gpusnap::cli
