#include "cli/help.h"

#include <cctype>

namespace gpusnap::cli {

namespace {

constexpr size_t kWidth = 78;
constexpr size_t kNameColumn = 15;  // "  checkpoint   " and then the sentence

const char* const kExitCodes[] = {
    "0 ok",           "1 internal error",    "2 usage",          "3 not found",
    "4 bad artifact", "5 incompatible host", "6 not capturable", "7 CRIU failed",
    "8 GPU",          "9 handshake",         "10 environment",   "11 timeout"};

// `text` on lines of at most kWidth, each after `indent` blanks but the first, which follows
// whatever the caller printed before it.
std::string wrap(const std::string& text, size_t indent, size_t first_column) {
  std::string out, word;
  size_t column = first_column;
  bool line_empty = true;
  auto flush = [&] {
    if (word.empty()) return;
    if (!line_empty && column + 1 + word.size() > kWidth) {
      out += "\n" + std::string(indent, ' ');
      column = indent;
      line_empty = true;
    }
    if (!line_empty) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
    line_empty = false;
    word.clear();
  };
  for (char c : text) {
    if (c == ' ' || c == '\n') {
      flush();
    } else {
      word += c;
    }
  }
  flush();
  return out;
}

// Text for roff: a backslash is printed as one, a line starting with '.' or '\'' is no request,
// and '-' is a hyphen-minus (as options are typed), not a hyphen.
std::string roff(const std::string& text) {
  std::string out;
  bool line_start = true;
  for (char c : text) {
    if (line_start && (c == '.' || c == '\'')) out += "\\&";
    if (c == '\\') {
      out += "\\e";
    } else if (c == '-') {
      out += "\\-";
    } else {
      out += c;
    }
    line_start = c == '\n';
  }
  return out;
}

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::string first_sentence(const std::string& summary) {
  std::string one_line;
  for (char c : summary) one_line += c == '\n' ? ' ' : c;
  // A sentence ends at ". " (or the summary's end); "e.g. " and the like do not occur in the
  // table's first sentences.
  const auto end = one_line.find(". ");
  return end == std::string::npos ? one_line : one_line.substr(0, end + 1);
}

std::string overview(const std::vector<Command>& cmds) {
  std::string out =
      "usage: gpusnap [--agent SOCKET] COMMAND [options]\n\n"
      "Capture an initialised workload (CPU and GPU memory) and start copies of it.\n"
      "With --agent (or $GPUSNAP_AGENT), checkpoint, restore, inspect and list run\n"
      "through gpusnap-agent, and ARTIFACT names a snapshot in the agent's storage.\n\n"
      "commands:\n";
  for (const auto& c : cmds) {
    std::string head = "  " + c.name;
    head.resize(std::max(kNameColumn, head.size() + 1), ' ');
    out += head + wrap(first_sentence(c.summary), kNameColumn, head.size()) + "\n";
  }
  std::string codes;
  for (const char* code : kExitCodes) codes += (codes.empty() ? "" : ", ") + std::string(code);
  out += "\n" +
         wrap("`gpusnap help COMMAND` (or `gpusnap COMMAND --help`) describes each. Exit codes: " +
                  codes + ".",
              0, 0) +
         "\n";
  return out;
}

std::string man_page(const Command& cmd, const std::string& version) {
  // gpusnap.1 is the tool's own page; every other is gpusnap-COMMAND.1.
  const std::string page = cmd.name == "gpusnap" ? cmd.name : "gpusnap-" + cmd.name;
  std::string out =
      ".TH " + upper(page) + " 1 \"\" \"gpusnap " + roff(version) + "\" \"gpusnap\"\n";
  out += ".SH NAME\n" + roff(page) + " \\- " + roff(first_sentence(cmd.summary)) + "\n";
  std::string usage = cmd.usage;
  if (usage.rfind("gpusnap ", 0) == 0) usage = usage.substr(8);
  out += ".SH SYNOPSIS\n.B gpusnap\n" + roff(usage) + "\n";
  std::string description;
  for (char c : cmd.summary) description += c == '\n' ? ' ' : c;
  out += ".SH DESCRIPTION\n" + roff(description) + "\n";
  out += ".SH OPTIONS\n";
  for (const auto& f : cmd.flags) {
    std::string term = "\\fB" + roff(f.name) + "\\fR";
    if (!f.short_name.empty()) term = "\\fB" + roff(f.short_name) + "\\fR, " + term;
    if (!f.value_name.empty()) term += " \\fI" + roff(f.value_name) + "\\fR";
    out += ".TP\n" + term + "\n" + roff(f.help) + "\n";
  }
  out += ".SH EXIT STATUS\n";
  for (const char* code : kExitCodes) out += ".TP\n" + roff(code) + "\n";
  out += ".SH SEE ALSO\n\\fBgpusnap\\fR(1), the project's docs/design.md\n";
  return out;
}

std::string bash_completion(const std::vector<Command>& cmds) {
  std::string names = "help version completion";
  for (const auto& c : cmds) names += " " + c.name;
  std::string cases;
  for (const auto& c : cmds) {
    std::string flags;
    for (const auto& f : c.flags) {
      flags += (flags.empty() ? "" : " ") + f.name;
      if (!f.short_name.empty()) flags += " " + f.short_name;
    }
    cases += "    " + c.name + ") words=\"" + flags + "\" ;;\n";
  }
  return "# bash completion for gpusnap, made by `gpusnap completion bash` from its command "
         "table.\n"
         "# Install: gpusnap completion bash >/etc/bash_completion.d/gpusnap\n"
         "_gpusnap() {\n"
         "  local cur=${COMP_WORDS[COMP_CWORD]} cmd='' words='' i\n"
         "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
         "    case ${COMP_WORDS[i]} in\n"
         "    --agent) ((i++)) ;;\n"
         "    -*) ;;\n"
         "    *) cmd=${COMP_WORDS[i]}; break ;;\n"
         "    esac\n"
         "  done\n"
         "  COMPREPLY=()\n"
         "  case $cmd in\n"
         "    '') words=\"--agent --help --version " +
         names +
         "\" ;;\n"
         "    help) words=\"" +
         names +
         "\" ;;\n"
         "    completion) words=bash ;;\n" +
         cases +
         "  esac\n"
         "  # Flags where one is being typed (and for the words above); else files (-o default).\n"
         "  if [[ -z $cmd || $cmd == help || $cmd == completion || $cur == -* ]]; then\n"
         "    mapfile -t COMPREPLY < <(compgen -W \"$words\" -- \"$cur\")\n"
         "  fi\n"
         "}\n"
         "complete -o default -F _gpusnap gpusnap\n";
}

}  // namespace gpusnap::cli
