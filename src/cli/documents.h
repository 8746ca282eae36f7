// The documents gpusnap prints: the JSON of `--json` and its human form. The CLI prints them for
// a command run here; the agent (src/agent) answers with the same documents, built by the same
// functions, so that `gpusnap --agent ...` prints exactly what the direct command prints.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"

namespace gpusnap::cli {

// `gpusnap checkpoint --json`; `notes` are what the engine told a person on the way.
nlohmann::json checkpoint_document(const CheckpointResult& result, bool leave_running,
                                   const std::vector<std::string>& notes);
// The one line `gpusnap checkpoint` prints for a person.
void print_checkpoint_human(const nlohmann::json& doc);

// `gpusnap restore --json`.
nlohmann::json restore_document(const RestoreResult& result, const std::filesystem::path& artifact,
                                const std::vector<std::string>& notes);
// A line per copy, then (unless quiet) a summary line.
void print_restore_human(const nlohmann::json& doc, bool quiet);

// `gpusnap inspect --json`: the manifest, with the artifact's path and total size.
nlohmann::json inspect_document(const Artifact& artifact);
// What `gpusnap inspect` prints for a person, from that document.
void print_inspect_human(const nlohmann::json& doc);

// `gpusnap list --json`: every artifact directly under `dir`, sorted by name. Hidden entries
// (staging directories) are skipped; one that cannot be opened is listed with its "error".
// Throws Error(kNotFound) when `dir` does not exist.
nlohmann::json list_document(const std::filesystem::path& dir);
void print_list_human(const nlohmann::json& doc);

}  // namespace gpusnap::cli
