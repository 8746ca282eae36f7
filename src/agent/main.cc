// gpusnap-agent: the node daemon. Serves the agent API (docs/design.md, "The agent") on a Unix
// socket, and optionally on TCP with a bearer token, and runs checkpoints and restores with
// the engine in this process. main() reads the flags, binds the sockets, recovers what a
// previous agent left, serves until SIGTERM or SIGINT, and maps any Error to its exit code.
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "agent/agent.h"
#include "agent/log.h"
#include "agent/metrics_listener.h"
#include "agent/server.h"
#include "common/args.h"
#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/flags.h"
#include "store/peers.h"
#include "store/transfer.h"

namespace gpusnap::agent {

namespace {

constexpr const char* kRegistryPrefix = "--registry-";

// The registry's flags are gpusnap's own (store/flags.h) after "--registry-".
std::vector<args::FlagSpec> flags() {
  std::vector<args::FlagSpec> f = {
      {"--socket", "", "PATH", "the Unix socket to serve (default /run/gpusnap/agent.sock)"},
      {"--socket-group", "", "GROUP", "the group that may use the socket (name or gid)"},
      {"--artifact-group", "", "GROUP",
       "the group that may read the artifacts (name or gid; default: root only)"},
      {"--listen", "", "ADDR:PORT", "also serve TCP (requires --token-file; port 0: any)"},
      {"--token-file", "", "FILE", "the bearer token TCP callers must send (one line)"},
      {"--metrics-listen", "", "ADDR:PORT",
       "also serve GET /metrics alone on TCP, read-only and without a token (port 0: any)"},
      {"--storage", "", "DIR", "where artifacts live (default /var/lib/gpusnap/snapshots)"},
      {"--state-dir", "", "DIR", "the operations journal (default /var/lib/gpusnap/agent)"},
      {"--run-dir", "", "DIR", "the engine's run directory (default /run/gpusnap)"},
      {"--gpusnap", "", "PATH", "the gpusnap binary (default: beside gpusnap-agent)"},
      {"--criu", "", "PATH", "the criu binary (default: as gpusnap locates it)"},
      {"--registry", "", "oci://HOST[:PORT]/REPO",
       "registry storage: push each capture there as REPO:NAME, pull what a restore needs and "
       "this node does not hold"},
      {"--max-pending", "", "N",
       "pending operations each lane holds, checkpoints and restores in one, prefetches in the "
       "other; more are refused with 429 (default 64)"},
      {"--prefetch-workers", "", "N", "prefetches that run at once (default 1, at most 16)"},
      {"--serve-peers", "", "",
       "serve the chunks of the registry storage's snapshots to the other agents on TCP "
       "(GET /v1/chunks/, with the token), fetching each chunk a peer asks for once (requires "
       "--registry and --listen; docs/store.md, \"Agents serving each other the chunks\")"},
      {"--log-format", "", "text|json",
       "the log's lines: text, or JSON lines for a log pipeline (default text)"}};
  for (auto& more : {store::registry_flags(kRegistryPrefix), store::cache_flags()}) {
    f.insert(f.end(), more.begin(), more.end());
  }
  f.push_back(store::signature_policy_flag());
  f.push_back(store::decryption_key_flag());
  for (const auto& e : store::encrypt_flags()) f.push_back(e);
  f.push_back({"--help", "-h", "", "show this help"});
  f.push_back({"--version", "", "", "show the version"});
  return f;
}

const char* const kUsage = "gpusnap-agent [options]";
const char* const kSummary =
    "Serve gpusnap's checkpoints and restores to local callers over a Unix socket (mode 0660),\n"
    "and optionally over TCP with a bearer token. Checkpoints and restores run one at a time,\n"
    "prefetches in a lane of their own; each operation is journaled so that a restarted agent\n"
    "recovers and reports what its predecessor left, and logged as it starts and ends.";

Error usage(const std::string& what) {
  return Error(ErrorKind::kUsage, what, "see `gpusnap-agent --help`");
}

// The ADDR:PORT of --listen or --metrics-listen (`flag`): an IPv6 address in brackets
// ("[::]:7070") or bare ("fd00::5:7070", as $(POD_IP):PORT spells it; the port is after the
// last colon). Throws Error(kUsage).
std::pair<std::string, int> address_and_port(const std::string& flag, const std::string& where,
                                             const std::string& example) {
  const auto colon = where.rfind(':');
  char* end = nullptr;
  const long port =
      colon == std::string::npos ? -1 : std::strtol(where.c_str() + colon + 1, &end, 10);
  std::string address = colon == std::string::npos ? "" : where.substr(0, colon);
  if (!address.empty() && (address.front() == '[' || address.back() == ']')) {
    const bool paired = address.size() > 2 && address.front() == '[' && address.back() == ']';
    address = paired ? address.substr(1, address.size() - 2) : "";
  }
  if (address.empty() || end == nullptr || *end != '\0' || port < 0 || port > 65535) {
    throw usage("bad " + flag + " '" + where + "': use ADDR:PORT, e.g. " + example);
  }
  return {address, static_cast<int>(port)};
}

// The gpusnap binary that runs the engine's helper processes (the dump guardian, a copy's
// init): the agent itself cannot, it is another program.
std::string helper_binary(const args::Args& args) {
  std::filesystem::path path = args.get("--gpusnap");
  if (path.empty()) {
    path = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "gpusnap";
  }
  if (::access(path.c_str(), X_OK) != 0) {
    throw Error(ErrorKind::kEnvironment, "no gpusnap binary at " + path.string(),
                "install gpusnap beside gpusnap-agent, or name it with --gpusnap PATH");
  }
  return std::filesystem::absolute(path).string();
}

// The registry storage, when --registry asks for it; checked by RegistryStorage
// (agent/registry_storage.h).
std::optional<RegistryStorageSettings> remote_settings(const args::Args& args,
                                                       const std::filesystem::path& run_dir) {
  if (!args.has("--registry")) {
    for (const auto& more : {store::registry_flags(kRegistryPrefix),
                             store::cache_flags(),
                             {store::signature_policy_flag(), store::decryption_key_flag()},
                             store::encrypt_flags()}) {
      for (const auto& flag : more) {
        if (args.has(flag.name)) throw usage(flag.name + " needs --registry");
      }
    }
    return std::nullopt;
  }
  RegistryStorageSettings s;
  s.repository = args.get("--registry");
  store::read_registry_flags(args, kRegistryPrefix, s.registry);
  s.cache = store::cache_flag(args);
  s.cache_budget = store::cache_budget_flag(args);
  s.policy = store::signature_policy(args);
  // Read once, now: a key file others may read stops the agent before it serves (exit 12).
  s.decryption = store::decryption_keys(args);
  store::TransferOptions encrypt;
  store::read_encrypt_flags(args, encrypt);
  if (!encrypt.recipients.empty()) {
    // The recipients and the dedup secret checked (and the secret made) before the first push.
    store::ChunkSealer check(encrypt.recipients, encrypt.dedup_secret);
    s.recipients = encrypt.recipients;
    s.dedup_secret = encrypt.dedup_secret;
  }
  // Beside `gpusnap restore oci://...`'s: a snapshot either pulled is found by the other.
  s.pulled = run_dir / "pulled";
  return s;
}

// The chunks this agent serves its peers (--serve-peers), from the registry storage's
// repository alone, with its credentials and registries.conf; null when it serves none. When
// its own --listen is among its peers, its own pulls ask it in-process: one fetch of each
// chunk serves both.
std::shared_ptr<store::PeerChunks> peer_chunks(const args::Args& args,
                                               std::optional<RegistryStorageSettings>& remote,
                                               const ListenOptions& listen) {
  if (!args.has("--serve-peers")) return nullptr;
  if (!remote) throw usage("--serve-peers needs --registry: peers are served its chunks");
  if (listen.tcp_address.empty()) {
    throw usage("--serve-peers needs --listen: peers ask over TCP");
  }
  const store::OciRef repository = store::OciRef::parse(remote->repository);
  store::PeerServing serving;
  serving.cache = remote->cache;
  serving.registry = remote->registry;
  serving.repositories = {repository.host + "/" + repository.repository};
  auto chunks = std::make_shared<store::PeerChunks>(std::move(serving));
  // Matched against the peers each time a chunk's owner is found: a name of --peers-dns
  // resolves to the pod's address, which --listen=$(POD_IP):PORT names too (store::peer_name
  // writes both alike, an IPv6 address in brackets).
  if (const auto& peers = remote->registry.peers) {
    peers->serve_self(store::peer_name(listen.tcp_address, listen.tcp_port), chunks);
  }
  return chunks;
}

void make_private_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) return;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw sys_error("create " + dir.string(), ec.value());
  // Artifacts hold the workloads' memory, secrets included.
  if (::chmod(dir.c_str(), 0700) != 0) throw sys_error("chmod " + dir.string(), errno);
}

// The handler only has to exist: a client that hangs up makes a write fail with EPIPE instead
// of killing the agent. A handler, unlike SIG_IGN, is not inherited by the programs the engine
// execs.
void on_sigpipe(int /*signal*/) {}

// `format` is set as soon as the flags are read: main() writes an error in it.
int run(const std::vector<std::string>& argv, LogFormat& format) {
  std::optional<args::Args> parsed;
  try {
    parsed.emplace("agent", flags(), argv);
  } catch (const Error& e) {
    throw usage(e.what());
  }
  const args::Args& args = *parsed;
  if (args.has("--help")) {
    std::fputs(args::format_help(kUsage, kSummary, flags()).c_str(), stdout);
    return 0;
  }
  if (args.has("--version")) {
    std::printf("gpusnap-agent %s\n", GPUSNAP_VERSION);
    return 0;
  }
  if (!args.positional().empty()) throw usage("unexpected argument '" + args.positional()[0] + "'");
  format = log_format_from_name(args.get("--log-format", "text"));
  if (::geteuid() != 0) {
    throw Error(ErrorKind::kEnvironment, "gpusnap-agent must run as root",
                "CRIU and the GPU driver's checkpoint calls need root");
  }

  ListenOptions listen;
  std::optional<gid_t> config_group;
  listen.socket_path = args.get("--socket", listen.socket_path);
  if (args.has("--socket-group")) {
    // Before any thread exists: group_id is not thread-safe.
    listen.socket_group = args::group_id("--socket-group", args.get("--socket-group"));
  }
  if (args.has("--artifact-group")) {
    config_group = args::group_id("--artifact-group", args.get("--artifact-group"));
  }
  if (args.has("--listen") != args.has("--token-file")) {
    throw usage("--listen and --token-file go together: TCP callers must send a token");
  }
  if (args.has("--listen")) {
    std::tie(listen.tcp_address, listen.tcp_port) =
        address_and_port("--listen", args.get("--listen"), "127.0.0.1:7070");
    listen.token = fs::read_token_file(args.get("--token-file"), "--token-file");
  }

  std::optional<std::pair<std::string, int>> metrics_at;
  if (args.has("--metrics-listen")) {
    metrics_at = address_and_port("--metrics-listen", args.get("--metrics-listen"), "0.0.0.0:9464");
  }

  AgentConfig config;
  // In the form the engine names its staging directories' parent (artifact/writer.h): the
  // recovery recognises a dead agent's dump by it.
  config.engine.storage =
      std::filesystem::absolute(args.get("--storage", "/var/lib/gpusnap/snapshots"))
          .lexically_normal();
  if (config.engine.storage.filename().empty()) {
    config.engine.storage = config.engine.storage.parent_path();
  }
  config.engine.run_dir = args.get("--run-dir", "/run/gpusnap");
  config.engine.helper_binary = helper_binary(args);
  config.engine.criu_path = args.get("--criu");
  config.engine.artifact_group = config_group;
  config.state_dir = args.get("--state-dir", config.state_dir.string());
  config.remote = remote_settings(args, config.engine.run_dir);
  config.max_pending = static_cast<size_t>(args.get_int("--max-pending", 64, 1, 1 << 20));
  config.prefetch_workers = static_cast<size_t>(args.get_int("--prefetch-workers", 1, 1, 16));
  config.log_format = format;
  config.peer_chunks = peer_chunks(args, config.remote, listen);
  make_private_dir(config.engine.storage);
  make_private_dir(config.state_dir);

  // Signals are taken by sigwait below: block them before any thread exists, so that every
  // thread inherits the mask. Children get a clean mask (common/subprocess.cc).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  struct sigaction pipe_action {};
  pipe_action.sa_handler = on_sigpipe;
  ::sigaction(SIGPIPE, &pipe_action, nullptr);

  Server server(listen);  // binds first: single-threaded here (the socket's umask)
  std::optional<MetricsListener> metrics;
  if (metrics_at) metrics.emplace(metrics_at->first, metrics_at->second);
  Agent agent(config);  // recovers what a previous agent left, then takes work
  // Said before the first answer: whoever got one can read where the agent listens.
  std::string serving =
      std::string("gpusnap-agent ") + GPUSNAP_VERSION + ": serving " + listen.socket_path;
  if (server.tcp_port() > 0) {
    serving +=
        " and " + store::peer_name(listen.tcp_address, server.tcp_port()) + " (bearer token)";
  }
  if (metrics) serving += ", metrics on " + store::peer_name(metrics_at->first, metrics->port());
  serving += "; storage " + config.engine.storage.string();
  if (config.remote) serving += " and " + config.remote->repository;
  // Keys by file and fingerprint, never their bytes.
  if (config.remote && config.remote->decryption) {
    serving += "; decryption keys";
    for (const auto& k : config.remote->decryption->keys()) {
      serving += " " + k.file.string() + " (" + k.fingerprint + ")";
    }
  }
  if (config.remote && !config.remote->recipients.empty()) {
    serving += "; pushes encrypted for " + std::to_string(config.remote->recipients.size()) +
               " recipients";
  }
  agent.log().agent(serving);
  server.start(agent);
  if (metrics) metrics->start(agent);

  int signal = 0;
  ::sigwait(&stop_signals, &signal);
  agent.log().agent("signal " + std::to_string(signal) + ": finishing the running operations");
  server.stop();
  if (metrics) metrics->stop();
  agent.stop();
  return 0;
}

}  // namespace

}  // namespace gpusnap::agent

int main(int argc, char** argv) {
  auto format = gpusnap::agent::LogFormat::kText;
  try {
    return gpusnap::agent::run(std::vector<std::string>(argv + 1, argv + argc), format);
  } catch (const gpusnap::Error& e) {
    gpusnap::agent::EventLog(format).fatal(e);
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpusnap-agent: internal error: %s\n", e.what());
    return static_cast<int>(gpusnap::ErrorKind::kInternal);
  }
}
