// The human form of the documents gpusnap prints (engine/documents.h builds them): what a
// command run without --json prints, from the same document --json prints.
#pragma once

#include <nlohmann/json.hpp>

namespace gpusnap::cli {

// The one line `gpusnap checkpoint` prints for a person.
void print_checkpoint_human(const nlohmann::json& doc);
// A line per copy, then (unless quiet) a summary line.
void print_restore_human(const nlohmann::json& doc, bool quiet);
// What `gpusnap inspect` prints for a person, from that document.
void print_inspect_human(const nlohmann::json& doc);
void print_list_human(const nlohmann::json& doc);

}  // namespace gpusnap::cli
