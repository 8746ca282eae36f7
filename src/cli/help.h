// What gpusnap says about its own commands, all from the one command table in main.cc: the
// overview, each command's help, a man page per command and the shell completion. Generated
// rather than written beside the table, so that none of them can drift from the flags the
// parser accepts.
#pragma once

#include <string>
#include <vector>

#include "cli/store_cli.h"

namespace gpusnap::cli {

// The summary's first sentence on one line: the overview's line for the command. A summary is
// wrapped at 80 columns in the table; cutting it at the first newline cut sentences in half.
std::string first_sentence(const std::string& summary);

// `gpusnap --help`: usage, the commands with their first sentences (wrapped under one
// another), and the exit codes.
std::string overview(const std::vector<Command>& cmds);

// The man page of one command, in roff (man(7)): NAME, SYNOPSIS, DESCRIPTION, OPTIONS, EXIT
// STATUS, SEE ALSO. Text from the table is escaped, so a flag's help cannot start a request.
std::string man_page(const Command& cmd, const std::string& version);

// A bash completion script for gpusnap: command names, then each command's flags.
std::string bash_completion(const std::vector<Command>& cmds);

}  // namespace gpusnap::cli
