#include "common.hpp"

#include "arg.h"
#include "download.h"
#include "log.h"
#include "preset.h"

#include <unistd.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>

// ---- router mode ----------------------------------------------------------------------------

// Options a router keeps to itself: TLS, keys and the model list belong to the router only.
static void router_unset_reserved(common_preset & preset, bool model_args) {
    for (const char * env : {"LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE",
                             "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_MAX", "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_AUTOLOAD"}) {
        preset.unset_option(env);
    }
    if (model_args) {
        for (const char * env : {"LLAMA_ARG_MODEL", "LLAMA_ARG_MMPROJ", "LLAMA_ARG_ALIAS", "LLAMA_ARG_HF_REPO"}) {
            preset.unset_option(env);
        }
    }
}

static std::set<std::string> router_csv_set(const common_preset & preset, const char * env) {
    std::set<std::string> out;
    std::string csv;
    if (preset.get_option(env, csv)) {
        for (auto & item : string_split<std::string>(csv, ',')) {
            item = string_strip(item);
            if (!item.empty()) {
                out.insert(item);
            }
        }
    }
    return out;
}

char * strata_router_models(int argc, char ** argv, const char * models_dir, const char * models_preset, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        common_preset_context ctx(LLAMA_EXAMPLE_SERVER);
        common_preset base = ctx.load_from_args(argc, argv);
        router_unset_reserved(base, true);
        base.unset_option("LLAMA_ARG_LOG_FILE");

        common_presets cached = ctx.load_from_cache();
        common_presets local;
        if (models_dir && *models_dir) {
            local = ctx.load_from_models_dir(models_dir);
        }
        common_preset global;
        common_presets custom;
        if (models_preset && *models_preset) {
            custom = ctx.load_from_ini(models_preset, global);
        }
        cached = ctx.cascade(global, cached);
        local  = ctx.cascade(global, local);
        custom = ctx.cascade(global, custom);

        common_presets all;
        std::map<std::string, std::string> source;
        for (const auto & [name, p] : cached) { all[name] = p; source[name] = "cache"; }
        for (const auto & [name, p] : local)  { all[name] = p; source[name] = "models_dir"; }
        for (const auto & [name, p] : custom) {
            if (all.count(name)) { all[name].merge(p); } else { all[name] = p; }
            source[name] = "preset";
        }

        std::set<std::string> deduped_paths;
        for (const auto & [name, p] : custom) {
            std::string val;
            if (!p.get_option(COMMON_ARG_PRESET_DEDUP_CACHE_MODELS, val) || !common_arg_utils::is_truthy(val)) {
                continue;
            }
            for (auto [repo_env, file_env] : {std::pair{"LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE"},
                                              std::pair{"LLAMA_ARG_SPEC_DRAFT_HF_REPO", "LLAMA_ARG_SPEC_DRAFT_MODEL"}}) {
                std::string repo, file;
                if (p.get_option(repo_env, repo) && !repo.empty()) {
                    p.get_option(file_env, file);
                    std::string path = common_download_resolve_path(repo, file);
                    if (!path.empty()) {
                        deduped_paths.insert(path);
                    }
                }
            }
        }

        const bool colors = common_log_get_colors(common_log_main());
        json out = json::array();
        for (auto & [name, p] : all) {
            p.merge(base);
            router_unset_reserved(p, false);
            std::set<std::string> aliases = router_csv_set(p, "LLAMA_ARG_ALIAS");
            std::set<std::string> tags    = router_csv_set(p, "LLAMA_ARG_TAGS");
            p.unset_option("LLAMA_ARG_PORT");
            p.set_option(ctx, "LLAMA_ARG_HOST", "127.0.0.1");
            p.set_option(ctx, "LLAMA_ARG_ALIAS", name);
            p.set_option(ctx, "LLAMA_ARG_LOG_COLORS", colors ? "on" : "off");
            common_preset shown = p;
            for (const char * env : {"LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_ALIAS", "LLAMA_ARG_TAGS"}) {
                shown.unset_option(env);
            }
            std::string stop_timeout, on_startup;
            p.get_option(COMMON_ARG_PRESET_STOP_TIMEOUT, stop_timeout);
            p.get_option(COMMON_ARG_PRESET_LOAD_ON_STARTUP, on_startup);
            bool hidden = false;
            if (source[name] == "cache" && !deduped_paths.empty()) {
                std::string path = common_download_resolve_path(name);
                hidden = !path.empty() && deduped_paths.count(path) > 0;
            }
            out.push_back({
                {"name", name},
                {"source", source[name]},
                {"args", p.to_args()},
                {"ini", p.name.empty() ? json(nullptr) : json(shown.to_ini())},
                {"aliases", aliases},
                {"tags", tags},
                {"stop_timeout", stop_timeout},
                {"load_on_startup", !on_startup.empty() && common_arg_utils::is_truthy(on_startup)},
                {"hidden", hidden},
            });
        }
        return dup_string(out.dump());
    });
}

bool strata_router_check_repo(const char * repo, const char * hf_token, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_params c;
        c.model.hf_repo = repo;
        c.hf_token      = hf_token;
        common_models_handler_init(c, LLAMA_EXAMPLE_SERVER);
        return true;
    });
}

bool strata_router_download(strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_models_handler handler = common_models_handler_init(p->params, LLAMA_EXAMPLE_SERVER);
        common_models_handler_apply(handler, p->params);
        return true;
    });
}

bool strata_params_resolve_models(strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_models_handler handler;
        if (!p->params.model.hf_repo.empty()) {
            handler = common_models_handler_init(p->params, LLAMA_EXAMPLE_SERVER);
        }
        common_models_handler_apply(handler, p->params);
        return true;
    });
}

bool strata_router_remove_cached(const char * repo) {
    try {
        return common_download_remove(repo);
    } catch (...) {
        return false;
    }
}

int strata_reserve_stdout(void) {
    std::fflush(stdout);
    int fd = dup(STDOUT_FILENO);
    if (fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        return -1;
    }
    return fd;
}
