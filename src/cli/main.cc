// gpusnap's command line. main() parses the subcommand, runs it, prints the result (human or
// --json) and maps any Error to its exit code. Only main exits.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/agent_client.h"
#include "cli/documents.h"
#include "cli/help.h"
#include "cli/store_cli.h"
#include "common/args.h"
#include "common/fs.h"
#include "common/proc.h"
#include "container/enter.h"
#include "engine/container_init.h"
#include "engine/copy_init.h"
#include "engine/documents.h"
#include "engine/dump_guard.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "engine/launch.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "store/transfer.h"

namespace gpusnap::cli {

using args::Args;
using args::FlagSpec;
using args::format_help;

namespace {

using nlohmann::json;

const FlagSpec kJson{"--json", "", "", "print the result as one JSON document on stdout"};
const FlagSpec kQuiet{"--quiet", "-q", "", "print no progress"};
const FlagSpec kCriu{"--criu", "", "PATH",
                     "the criu binary (default: $GPUSNAP_CRIU, "
                     "/opt/gpusnap/criu/criu, criu on PATH)"};
const FlagSpec kGroup{"--group", "", "GROUP",
                      "let GROUP read the artifact (name or gid; default: root only)"};
const FlagSpec kHelp{"--help", "-h", "", "show this help"};
const FlagSpec kNoHostImages{"--no-host-images", "", "",
                             "store GPU memory through CRIU's pages, not as host images"};
const FlagSpec kNoDirectHostImages{
    "--no-direct-host-images", "", "",
    "copy the driver's memory into the artifact after its checkpoint, even where "
    "libgpusnap-preload.so could have it written there directly"};
const FlagSpec kHostImageFile{
    "--host-image-file-mib", "", "MIB",
    "split host images into files of at most MIB (default: one per region)"};
const FlagSpec kIoThreads{"--io-threads", "", "N",
                          "threads that write host images (default: one per core, at least 4)"};

// Keeps the notes of a command whose output is JSON: they go into the document.
class NoteCollector final : public Reporter {
 public:
  void note(std::string_view text) override { notes.emplace_back(text); }
  std::vector<std::string> notes;
};

// Output settings shared by every command.
struct Output {
  bool json = false;
  bool quiet = false;
  std::unique_ptr<Reporter> reporter;

  // What the command noted on the way (JSON output only; a terminal shows them as they come).
  std::vector<std::string> notes() const {
    auto* collector = dynamic_cast<NoteCollector*>(reporter.get());
    return collector ? collector->notes : std::vector<std::string>{};
  }

  explicit Output(const Args& args) : json(args.has("--json")), quiet(args.has("--quiet")) {
    if (json) {
      reporter = std::make_unique<NoteCollector>();
    } else if (quiet) {
      reporter = std::make_unique<Reporter>();
    } else {
      reporter = std::make_unique<TerminalReporter>(::isatty(STDERR_FILENO) == 1);
    }
  }

  // Prints a command's document: as JSON with --json, else in its human form.
  void print(const nlohmann::json& doc,
             const std::function<void(const nlohmann::json&)>& human) const {
    if (json) {
      std::cout << doc.dump(2) << "\n";
    } else {
      human(doc);
    }
  }
};

void print_checkpoint(const Output& out, const CheckpointResult& r, bool leave_running);

// The capture settings `checkpoint` and `run` share; flags a command does not declare keep
// their defaults.
CheckpointOptions capture_options(const Args& args) {
  if (!args.has("--output")) throw args.usage_error(args.command() + " needs -o ARTIFACT");
  if (args.get("--output").empty()) throw args.usage_error("-o needs a path, not an empty one");
  CheckpointOptions o;
  o.output = args.get("--output");
  if (args.has("--group")) o.artifact_group = args::group_id("--group", args.get("--group"));
  o.leave_running = args.has("--leave-running");
  o.criu_path = args.get("--criu");
  o.ghost_limit = static_cast<uint64_t>(args.get_int("--ghost-limit-mib", 256, 0, 1 << 20)) << 20;
  o.gpu_lock_timeout = std::chrono::seconds(args.get_int("--gpu-lock-timeout", 10, 1, 3600));
  o.handshake = !args.has("--no-handshake");
  o.handshake_timeout = std::chrono::seconds(args.get_int("--handshake-timeout", 60, 1, 86400));
  o.host_images = !args.has("--no-host-images");
  o.direct_host_images = !args.has("--no-direct-host-images");
  o.io_threads = static_cast<int>(args.get_int("--io-threads", 0, 0, 256));
  o.host_image_file_bytes =
      static_cast<uint64_t>(args.get_int("--host-image-file-mib", 0, 0, 1 << 24)) << 20;
  return o;
}

// --container ID [--runtime-root DIR], or nothing when --container is absent.
std::optional<ContainerRef> container_ref(const Args& args, const std::string& flag) {
  if (!args.has(flag)) {
    if (args.has("--runtime-root")) throw args.usage_error("--runtime-root goes with " + flag);
    return std::nullopt;
  }
  ContainerRef ref;
  ref.id = args.get(flag);
  if (args.has("--runtime-root")) ref.runtime_root = args.get("--runtime-root");
  return ref;
}

int cmd_checkpoint(const Args& args) {
  args.no_positional();
  Output out(args);
  if (args.has("--pid") == args.has("--container")) {
    throw args.usage_error("checkpoint needs either --pid PID or --container ID");
  }
  CheckpointOptions o = capture_options(args);
  o.container = container_ref(args, "--container");
  if (!o.container) o.pid = static_cast<pid_t>(args.get_int("--pid", 0, 1, 1L << 22));
  auto r = checkpoint(o, *out.reporter);
  print_checkpoint(out, r, o.leave_running);
  return 0;
}

void print_checkpoint(const Output& out, const CheckpointResult& r, bool leave_running) {
  out.print(engine::checkpoint_document(r, leave_running, out.notes()), [&](const json& doc) {
    if (!out.quiet) print_checkpoint_human(doc);
  });
}

int cmd_restore(const Args& args) {
  Output out(args);
  RestoreOptions o;
  o.artifact = args.only_artifact();
  o.replicas = static_cast<int>(args.get_int("--replicas", 1, 1, 1024));
  o.verify = !args.has("--no-verify");
  o.criu_path = args.get("--criu");
  o.into_container = container_ref(args, "--into-container");
  for (const auto& p : args.all("--publish")) o.publish.push_back(PortPublish::parse(p));
  for (const auto& m : args.all("--gpu-map")) {
    for (size_t start = 0; start <= m.size();) {  // "a=b,c=d" or the flag repeated
      auto comma = std::min(m.find(',', start), m.size());
      o.gpu_map.push_back(m.substr(start, comma - start));
      start = comma + 1;
    }
  }
  if (args.has("--run-dir")) o.run_dir = args.get("--run-dir");
  o.timeout = std::chrono::seconds(args.get_int("--timeout", 300, 1, 86400));
  o.handshake_timeout = std::chrono::seconds(args.get_int("--handshake-timeout", 60, 1, 86400));
  for (const auto& kv : args.all("--set")) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw Error(ErrorKind::kUsage, "bad --set '" + kv + "'", "use --set KEY=VALUE");
    }
    o.settings[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  // Checked here once, and for oci:// pulled while it restores (store/reach.h).
  auto reached = reach_for_restore(args, o);
  reached.source->prepare(o);
  auto r = restore(o, *out.reporter);
  for (const auto& line : reached.notes()) out.reporter->note(line);
  if (auto line = reached.source->summary(); !line.empty()) out.reporter->note(line);
  json doc = engine::restore_document(r, o.artifact, out.notes());
  if (o.into_container) doc["into_container"] = o.into_container->id;
  out.print(doc, [&](const json& d) { print_restore_human(d, out.quiet); });
  return 0;
}

int cmd_inspect(const Args& args) {
  if (is_remote(args.only_artifact())) return inspect_remote(args, args.only_artifact());
  Output out(args);
  out.print(engine::inspect_document(Artifact::open(args.only_artifact())), print_inspect_human);
  return 0;
}

int cmd_list(const Args& args) {
  if (args.has("--cache")) return list_cache(args);
  Output out(args);
  if (args.positional().size() > 1) throw args.usage_error("list takes at most one DIR");
  out.print(
      engine::list_document(args.positional().empty() ? kDefaultStorage : args.positional()[0]),
      print_list_human);
  return 0;
}

int cmd_verify(const Args& args) {
  if (is_remote(args.only_artifact())) return verify_remote(args, args.only_artifact());
  Output out(args);
  auto a = Artifact::open(args.only_artifact());
  Phases phases(*out.reporter);
  auto problems = phases.run("verify", [&] { return a.verify({0, out.reporter.get()}); });
  if (out.json) {
    json list = json::array();
    for (const auto& p : problems) list.push_back({{"path", p.path}, {"problem", p.problem}});
    std::cout << json{{"artifact", a.root().string()},
                      {"ok", problems.empty()},
                      {"bytes", a.manifest().total_bytes()},
                      {"problems", list},
                      {"seconds", phases.total_seconds()}}
                     .dump(2)
              << "\n";
  } else {
    for (const auto& p : problems) std::printf("%s: %s\n", p.path.c_str(), p.problem.c_str());
    if (problems.empty()) {
      std::printf("%s: ok, %s in %zu files verified in %.2f s\n", a.root().c_str(),
                  fs::human_bytes(a.manifest().total_bytes()).c_str(), a.manifest().files.size(),
                  phases.total_seconds());
    }
  }
  if (!problems.empty()) {
    if (!out.json) {
      std::fprintf(stderr, "gpusnap: error: artifact %s is corrupt: %zu problem(s)\n",
                   a.root().c_str(), problems.size());
    }
    return static_cast<int>(ErrorKind::kBadArtifact);
  }
  return 0;
}

int cmd_run(const Args& args) {
  args.no_positional();
  Output out(args);
  if (args.rest().empty()) throw args.usage_error("run needs a command after --");
  CheckpointOptions o = capture_options(args);
  auto ready_timeout = std::chrono::seconds(args.get_int("--ready-timeout", 600, 1, 86400));
  engine::LaunchOptions launch;
  launch.memory_tier = args.has("--memory-tier");
  engine::LaunchedWorkload workload(args.rest(), "/run/gpusnap", launch);
  out.reporter->note("launched pid " + std::to_string(workload.pid()) + ", output in " +
                     workload.log().string());
  if (launch.memory_tier) {
    out.reporter->note("memory tier: the workload's Python installs it when it imports torch (" +
                       (workload.python_site() / "sitecustomize.py").string() +
                       "; a failure is one line in its output)");
  }
  engine::Handshake handshake(workload.control_dir());
  Phases phases(*out.reporter);
  try {
    phases.run("wait-ready", [&] { handshake.wait_ready(workload.pid(), ready_timeout); });
  } catch (const Error& e) {
    // It never became capturable: it is ours, and of no use.
    throw Error(e.kind(), std::string(e.what()) + "; its output: " + workload.output_tail(),
                e.hint());
  }
  o.pid = workload.pid();
  o.control_dir = workload.control_dir();
  try {
    auto r = checkpoint(o, *out.reporter);
    workload.release();  // stopped by the capture, or left running as asked
    auto all = phases.timings();
    all.insert(all.end(), r.phases.begin(), r.phases.end());
    r.phases = all;
    print_checkpoint(out, r, o.leave_running);
  } catch (const Error& e) {
    workload.release();  // a failed capture leaves the workload running as it was
    throw Error(e.kind(),
                std::string(e.what()) + " (the workload, pid " + std::to_string(workload.pid()) +
                    ", was left running)",
                e.hint());
  }
  return 0;
}

int cmd_init(const Args& args) {
  if (args.has("--placeholder")) {
    if (!args.rest().empty() || !args.positional().empty()) {
      throw args.usage_error("init --placeholder takes no command");
    }
    if (args.has("--memory-tier")) {
      // A copy keeps the allocator its snapshot's process had: nothing to install at a restore.
      throw args.usage_error(
          "init --placeholder takes no --memory-tier (a restored copy has the tier its snapshot "
          "had): give it to the `gpusnap init` that starts the workload to capture");
    }
    return engine::placeholder_main();
  }
  engine::ShimOptions shim;
  shim.memory_tier = args.has("--memory-tier");
  return engine::shim_main(args.rest().empty() ? args.positional() : args.rest(), shim);
}

int cmd_recover(const Args& args) {
  args.no_positional();
  Output out(args);
  auto driver = gpu::open_nvidia_driver();
  const std::filesystem::path run_dir = args.get("--run-dir", "/run/gpusnap");
  std::vector<std::string> done = engine::recover_abandoned(*driver, run_dir);
  // Asked for here only, not at every checkpoint and restore: the next pull of the same
  // snapshot would resume from what a dead pull staged, but a node short of space wants it back.
  for (auto& line : store::remove_dead_pulls(run_dir / "pulled")) done.push_back(line);
  if (args.has("--pid")) {
    if (!driver->available()) {
      throw Error(ErrorKind::kEnvironment, "no NVIDIA driver here: " + driver->reason(),
                  "run recover on the host that runs the workload");
    }
    auto pid = static_cast<pid_t>(args.get_int("--pid", 0, 1, 1L << 22));
    auto tree = proc::read_tree(pid);
    auto more = engine::return_to_running(*driver, engine::cuda_processes(*driver, tree));
    done.insert(done.end(), more.begin(), more.end());
  }
  if (out.json) {
    std::cout << json{{"actions", done}}.dump(2) << "\n";
  } else {
    for (const auto& line : done) std::printf("%s\n", line.c_str());
    if (done.empty()) std::printf("nothing to recover\n");
  }
  return 0;
}

// push, pull and import, and the oci:// flags of restore, inspect, verify and list
// (cli/store_cli.h).
void add_store_commands(std::vector<Command>& cmds) {
  for (auto& c : cmds) extend_for_store(c.name, c.usage, c.summary, c.flags);
  auto more = store_commands();
  cmds.insert(cmds.end(), std::make_move_iterator(more.begin()),
              std::make_move_iterator(more.end()));
}

// The table of commands, one function per entry: its name, usage, summary, flags and what
// runs it. Help, man pages and the completion are all made from it (cli/help.h).
Command checkpoint_command() {
  return {
      "checkpoint",
      "gpusnap checkpoint (--pid PID | --container ID) -o ARTIFACT [options]",
      "Capture the process tree rooted at PID into a new artifact directory. The source is\n"
      "stopped after a successful capture unless --leave-running is given; on any failure it\n"
      "is left running and nothing appears at ARTIFACT.",
      {{"--pid", "-p", "PID", "root of the process tree to capture"},
       {"--output", "-o", "ARTIFACT", "artifact directory to create (must not exist)"},
       {"--leave-running", "", "", "keep the source running after the capture"},
       kGroup,
       {"--ghost-limit-mib", "", "MIB", "largest unlinked-but-open file to store (default 256)"},
       {"--gpu-lock-timeout", "", "SECONDS",
        "how long each CUDA process may take to drain its GPU work (default 10)"},
       {"--no-handshake", "", "", "capture as it runs even if the workload speaks the handshake"},
       {"--handshake-timeout", "", "SECONDS",
        "how long the workload may take to pause (default 60)"},
       kNoHostImages,
       kNoDirectHostImages,
       kHostImageFile,
       kIoThreads,
       {"--container", "", "ID",
        "capture the workload of this runc container (its PID 1: `gpusnap init -- CMD`)"},
       {"--runtime-root", "", "DIR",
        "runc's state directory (default: found among /run/runc and containerd's "
        "/run/containerd/runc/NAMESPACE)"},
       kCriu,
       kJson,
       kQuiet,
       kHelp},
      cmd_checkpoint};
}

Command run_command() {
  return {
      "run",
      "gpusnap run -o ARTIFACT [--leave-running] [--memory-tier] -- COMMAND [ARGS...]",
      "Launch a workload so that it can be captured (own session, output to a log, io_uring\n"
      "refused, a handshake directory in $GPUSNAP_CONTROL_DIR, libgpusnap-preload.so in\n"
      "LD_PRELOAD for a faster GPU checkpoint, XLA_PYTHON_CLIENT_PREALLOCATE=false unless set,\n"
      "as JAX with preallocation dies at the GPU checkpoint), wait until it says READY, pause\n"
      "it, capture it, then stop it or, with --leave-running, resume it.\n"
      "--memory-tier: a PyTorch workload speaking the handshake in Python gets the memory tier\n"
      "without calling use_memory_tier(): gpusnap's Python folder goes first on its PYTHONPATH\n"
      "(found by $GPUSNAP_PYTHON_SITE, else python/ beside gpusnap, else /opt/gpusnap/python)\n"
      "with GPUSNAP_MEMORY_TIER=1, and the tier is installed when it imports torch.",
      {{"--output", "-o", "ARTIFACT", "artifact directory to create (must not exist)"},
       {"--leave-running", "", "", "resume the workload after the capture"},
       {"--memory-tier", "", "",
        "have a Python workload install the memory tier when it imports torch"},
       kGroup,
       {"--ready-timeout", "", "SECONDS", "how long it may take to say READY (default 600)"},
       {"--handshake-timeout", "", "SECONDS", "how long it may take to pause (default 60)"},
       kNoHostImages,
       kNoDirectHostImages,
       kHostImageFile,
       kIoThreads,
       kCriu,
       kJson,
       kQuiet,
       kHelp},
      cmd_run};
}

Command restore_command() {
  return {
      "restore",
      "gpusnap restore ARTIFACT [--replicas N] [--publish [ADDR:][HOSTPORT:]PORT]...",
      "Start N copies of the captured workload. Each copy runs in fresh PID, mount, network,\n"
      "IPC and UTS namespaces, so copies and the source never clash. --publish makes a port of\n"
      "each copy reachable from the host: copy i listens on HOSTPORT+i (or a free port).\n"
      "Every byte is verified against the manifest before a copy can run (with GPU state:\n"
      "while CRIU restores, before any GPU state goes back).",
      {{"--replicas", "-n", "N", "number of copies (default 1)"},
       {"--publish", "", "[ADDR:][HOSTPORT:]PORT", "forward a host port to PORT in each copy",
        true},
       {"--gpu-map", "", "OLD=NEW[,...]",
        "restore GPU OLD of the artifact onto GPU NEW here (UUIDs or indexes)", true},
       {"--set", "", "KEY=VALUE", "a setting for the copies' resume context (handshake)", true},
       {"--handshake-timeout", "", "SECONDS", "how long each copy may take to resume (default 60)"},
       {"--no-verify", "", "", "skip the byte check (the format checks still run)"},
       {"--into-container", "", "ID",
        "restore into this runc container's namespaces (its PID 1: `gpusnap init "
        "--placeholder`)"},
       {"--runtime-root", "", "DIR",
        "runc's state directory (default: found among /run/runc and containerd's "
        "/run/containerd/runc/NAMESPACE)"},
       {"--run-dir", "", "DIR", "where copies keep logs and state (default /run/gpusnap)"},
       {"--timeout", "", "SECONDS", "give up on CRIU's restore after this long (default 300)"},
       kCriu,
       kJson,
       kQuiet,
       kHelp},
      cmd_restore};
}

Command init_command() {
  return {
      "init",
      "gpusnap init [--placeholder | --memory-tier] [-- COMMAND [ARGS...]]",
      "PID 1 of a container. With a command: run it (in its own session, with\n"
      "libgpusnap-preload.so in LD_PRELOAD), reap orphans, pass SIGTERM, SIGINT and SIGHUP on\n"
      "to it, exit with its status; the container can then be captured with `checkpoint\n"
      "--container`. With --placeholder: wait until `restore\n"
      "--into-container` puts a snapshot into this container, then do the same for it.\n"
      "--memory-tier: as for `gpusnap run`, a PyTorch workload speaking the handshake in Python\n"
      "gets the memory tier when it imports torch, through gpusnap's Python folder (python/\n"
      "beside this gpusnap: /opt/gpusnap/bin/python on a node, or $GPUSNAP_PYTHON_SITE).",
      {{"--placeholder", "", "", "wait for a snapshot to be restored into this container"},
       {"--memory-tier", "", "",
        "have a Python workload install the memory tier when it imports torch"},
       kHelp},
      cmd_init};
}

Command recover_command() {
  return {
      "recover",
      "gpusnap recover [--pid PID]",
      "Return to RUNNING every CUDA process a killed gpusnap left locked or checkpointed (from\n"
      "gpusnap's journal), or those of the tree at PID, and remove the staging directories a\n"
      "killed gpusnap left. Checkpoint and restore do this by themselves when they start;\n"
      "recover also removes what pulls that did not finish staged under RUN_DIR/pulled (which\n"
      "the next pull of the same snapshot would otherwise resume from).",
      {{"--pid", "-p", "PID", "also return this process tree's CUDA processes to RUNNING"},
       {"--run-dir", "", "DIR", "gpusnap's state directory (default /run/gpusnap)"},
       kJson,
       kHelp},
      cmd_recover};
}

Command inspect_command() {
  return {"inspect",
          "gpusnap inspect ARTIFACT [--json]",
          "Show what an artifact holds: processes, memory, sizes, the host facts a restore needs.",
          {kJson, kHelp},
          cmd_inspect};
}

Command verify_command() {
  return {"verify",
          "gpusnap verify ARTIFACT [--json]",
          "Check every byte of an artifact against its manifest.",
          {kJson, kQuiet, kHelp},
          cmd_verify};
}

Command list_command() {
  return {"list",
          "gpusnap list [DIR] [--json]",
          "List the artifacts in a snapshot directory (default " + std::string(kDefaultStorage) +
              ", the agent's storage).",
          {kJson, kHelp},
          cmd_list};
}

std::vector<Command> commands() {
  std::vector<Command> cmds{checkpoint_command(), run_command(),     restore_command(),
                            init_command(),       recover_command(), inspect_command(),
                            verify_command(),     list_command()};
  add_store_commands(cmds);
  return cmds;
}

// The command named `name`, or a usage error.
const Command& command_named(const std::vector<Command>& cmds, const std::string& name) {
  for (const auto& c : cmds) {
    if (c.name == name) return c;
  }
  throw Error(ErrorKind::kUsage, "unknown command '" + name + "'", "see `gpusnap --help`");
}

// Writes `text` to DIR/NAME through a temporary file, so that a reader never sees half a page.
// A man page holds nothing of a workload's: readable by all, as man(1) needs.
void write_page(const std::filesystem::path& dir, const std::string& name,
                const std::string& text) {
  fs::write_file_durable(dir / name, text);
  if (::chmod((dir / name).c_str(), 0644) != 0) throw sys_error("chmod " + name, errno);
}

// `gpusnap help [COMMAND]`, `gpusnap help --man COMMAND`, `gpusnap help --man-dir DIR` (a page
// per command and gpusnap.1, as the build makes them).
int cmd_help(const std::vector<Command>& cmds, const std::vector<std::string>& rest) {
  if (rest.empty()) {
    std::fputs(overview(cmds).c_str(), stdout);
    return 0;
  }
  if (rest.size() == 1 && rest[0][0] != '-') {
    const auto& c = command_named(cmds, rest[0]);
    std::fputs(format_help(c.usage, c.summary, c.flags).c_str(), stdout);
    return 0;
  }
  if (rest.size() == 2 && rest[0] == "--man") {
    std::fputs(man_page(command_named(cmds, rest[1]), GPUSNAP_VERSION).c_str(), stdout);
    return 0;
  }
  if (rest.size() == 2 && rest[0] == "--man-dir") {
    const std::filesystem::path dir = rest[1];
    std::filesystem::create_directories(dir);
    for (const auto& c : cmds) {
      write_page(dir, "gpusnap-" + c.name + ".1", man_page(c, GPUSNAP_VERSION));
    }
    // gpusnap.1's NAME line is its summary's first sentence: the tool's, not the usage line.
    const Command top{"gpusnap",
                      "gpusnap [--agent SOCKET] COMMAND [options]",
                      "Capture an initialised workload and start copies of it. " + overview(cmds),
                      {},
                      nullptr};
    write_page(dir, "gpusnap.1", man_page(top, GPUSNAP_VERSION));
    return 0;
  }
  throw Error(ErrorKind::kUsage, "help takes a command, --man COMMAND or --man-dir DIR",
              "see `gpusnap help`");
}

// `gpusnap [--agent SOCKET] version [--json]`. With --agent, the agent's version and node too:
// it answers only while it serves, so this is also the DaemonSet's probe of the agent.
int cmd_version(const AgentChoice& agent, const std::vector<std::string>& rest) {
  const bool json_out = rest.size() == 1 && rest[0] == "--json";
  if (!rest.empty() && !json_out) {
    throw Error(ErrorKind::kUsage, "version takes --json alone, not '" + rest[0] + "'",
                "see `gpusnap help`");
  }
  json doc{{"version", GPUSNAP_VERSION}};
  if (agent.from_flag) {
    const json health = agent_health(agent.socket);
    doc["agent"] = {{"version", health.value("version", "")}, {"node", health.value("node", "")}};
  }
  if (json_out) {
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::printf("gpusnap %s\n", GPUSNAP_VERSION);
  if (doc.contains("agent")) {
    std::printf("agent %s on node %s (%s)\n", doc["agent"]["version"].get<std::string>().c_str(),
                doc["agent"]["node"].get<std::string>().c_str(), agent.socket.c_str());
  }
  return 0;
}

// `gpusnap completion bash`.
int cmd_completion(const std::vector<Command>& cmds, const std::vector<std::string>& rest) {
  if (rest.size() != 1 || rest[0] != "bash") {
    throw Error(ErrorKind::kUsage, "completion takes the shell's name: bash",
                "gpusnap completion bash >/etc/bash_completion.d/gpusnap");
  }
  std::fputs(bash_completion(cmds).c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> all(argv + 1, argv + argc);
  auto cmds = commands();
  bool json_wanted = false;
  for (const auto& a : all) json_wanted |= a == "--json";
  try {
    const AgentChoice agent = take_agent_flag(all);
    // gpusnap's own helper processes, started by the engine, not by users.
    if (all.size() == 2 && all[0] == "__dump-guard") return engine::dump_guard_main(all[1]);
    if (all.size() == 2 && all[0] == "__container-exec") return container::exec_main(all[1]);
    if (all.size() == 2 && all[0] == "__copy-init") {
      return engine::copy_init_main(engine::copy_init_spec_from_json(all[1]));
    }
    if (all.empty()) {
      std::fputs(overview(cmds).c_str(), stdout);
      return static_cast<int>(ErrorKind::kUsage);
    }
    const std::vector<std::string> after(all.begin() + 1, all.end());
    if (all[0] == "--help" || all[0] == "-h" || all[0] == "help") return cmd_help(cmds, after);
    if (all[0] == "--version" || all[0] == "version") return cmd_version(agent, after);
    if (all[0] == "completion") return cmd_completion(cmds, after);
    for (const auto& c : cmds) {
      if (c.name != all[0]) continue;
      std::vector<std::string> rest(all.begin() + 1, all.end());
      Args args(c.name, c.flags, rest);
      if (args.has("--help")) {
        std::fputs(format_help(c.usage, c.summary, c.flags).c_str(), stdout);
        return 0;
      }
      if (agent.wanted(c.name)) return run_through_agent(agent.socket, args);
      return c.run(args);
    }
    throw Error(ErrorKind::kUsage, "unknown command '" + all[0] + "'", "see `gpusnap --help`");
  } catch (const Error& e) {
    if (json_wanted) {
      std::cout << json{{"error",
                         {{"kind", Error::kind_name(e.kind())},
                          {"message", e.what()},
                          {"hint", e.hint()},
                          {"exit_code", e.exit_code()}}}}
                       // A message may quote a log line that is not UTF-8.
                       .dump(2, ' ', false, json::error_handler_t::replace)
                << "\n";
    }
    std::fprintf(stderr, "gpusnap: error: %s\n", e.one_line().c_str());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpusnap: internal error: %s\n", e.what());
    return static_cast<int>(ErrorKind::kInternal);
  }
}

}  // namespace gpusnap::cli

int main(int argc, char** argv) { return gpusnap::cli::main(argc, argv); }
